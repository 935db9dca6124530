"""Wire order: the one order in which two ranks exchange their messages.

NCCL ignores tags. Between two ranks, point-to-point operations match in the order they
are posted, and torch's ProcessGroupNCCL runs every send and receive of one pair of ranks
(both directions) in order on one stream, where a send may wait until the peer has posted
the matching receive. So both ranks of a pair must post the messages between them in one
and the same order, and that order must let both programs go on. For each pair this module
derives such an order from the lowered schedule alone, so that each rank computes it
without asking the other. The order must keep

1. a rank's sends to the peer in its program order (a send can be posted only once its
   SEND action has produced the data), and
2. message j before message i when a rank RECVs j before it SENDs i (it reaches SEND i
   only once j has arrived).

Each rule says "the SEND of the first message happens before the SEND of the second in
every run". So an order that keeps them makes a message wait only for SENDs that happen
before its own anyway, and runs on those streams whenever the schedule runs with messages
matched by name; and a cycle among the rules means the schedule deadlocks even then (the
validator rejects such schedules; ``wire_orders`` names the cycle). We take
one order that keeps them: replay the schedule once, one action at a time, with unit costs
(F = I = W = 1, B = 2, free messages), and order each pair's messages by when their SEND
ran. Every rule holds (a SEND follows the RECVs before it, and a RECV its own SEND). One
replay orders all pairs alike, which the runtime needs on NCCL: it may block on the header
of an earlier message of the order before it may post a later one, and such a wait is
then always for a SEND that came earlier in the replay, so waits never form a cycle, also
across three or more ranks (see ``pipetrain.runtime.transport``).

``check_order_matched`` runs a schedule against per-rank issue orders in a model of those
NCCL streams, with the runtime's header and look-ahead rules; the tests use it to show
that every built-in schedule completes with ``wire_orders`` and that bad orders fail.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.schedule import Schedule, ScheduleError

__all__ = [
    "Message",
    "PeerOrders",
    "WireCheck",
    "check_order_matched",
    "issue_orders",
    "message_of",
    "peer_orders",
    "wire_orders",
]

_SENDS = frozenset({Kind.SEND_F, Kind.SEND_B})
_RECVS = frozenset({Kind.RECV_F, Kind.RECV_B})
# Unit costs of the replay that orders the messages (messages are free).
_UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}

Pair = tuple[int, int]  # (lower rank, higher rank)
# One rank's wire orders: for each peer rank, the messages between the two in order.
PeerOrders = Mapping[int, tuple["Message", ...]]


@dataclass(frozen=True, order=True)
class Message:
    """One message of a step: what ``dst_stage`` receives from ``src_stage`` for a micro-batch."""

    src_rank: int
    dst_rank: int
    src_stage: int
    dst_stage: int
    is_grad: bool
    microbatch: int

    def __str__(self) -> str:
        what = "gradient" if self.is_grad else "activations"
        return f"{what} {self.src_stage}->{self.dst_stage} of micro-batch {self.microbatch}"

    @property
    def boundary(self) -> tuple[int, int, bool]:
        """(source stage, destination stage, is_grad): messages that share their shapes."""
        return self.src_stage, self.dst_stage, self.is_grad


def message_of(action: Action, schedule: Schedule) -> Message | None:
    """The message a SEND or RECV action moves; None for any other action."""
    placement, s, mb = schedule.placement, action.stage, action.microbatch
    if mb is None or action.kind not in _SENDS | _RECVS:
        return None
    is_grad = action.kind in (Kind.SEND_B, Kind.RECV_B)
    if action.kind in _SENDS:
        other = s - 1 if is_grad else s + 1
        src, dst = s, other
    else:
        other = s + 1 if is_grad else s - 1
        src, dst = other, s
    if not 0 <= other < placement.num_stages:
        raise ScheduleError(
            f"action {action} moves a message to or from stage {other}, which does not exist: "
            f"lower the schedule with pipetrain.schedules.lowering.lower"
        )
    return Message(placement.rank_of(src), placement.rank_of(dst), src, dst, is_grad, mb)


def _comm(schedule: Schedule) -> list[list[Message | None]]:
    """For each rank and position, the message of that action (None for compute)."""
    return [[message_of(a, schedule) for a in row] for row in schedule.actions]


def _pair(message: Message) -> Pair:
    a, b = message.src_rank, message.dst_rank
    return (a, b) if a < b else (b, a)


# ----------------------------------------------------------------- the order
def wire_orders(schedule: Schedule) -> dict[Pair, tuple[Message, ...]]:
    """For each pair of ranks that exchange messages, all of them in wire order (module doc).

    Raises ``ScheduleError`` when no order exists: the schedule cannot run at all.
    """
    comm = _comm(schedule)
    sends: dict[Message, int] = {}
    recvs: dict[Message, int] = {}
    for rank, row in enumerate(comm):
        for message in row:
            if message is None:
                continue
            own = sends if message.src_rank == rank else recvs
            if message in own:
                raise ScheduleError(
                    f"rank {rank} moves the {message} twice: each message is sent and received once"
                )
            own[message] = rank
    unmatched = set(sends) ^ set(recvs)
    if unmatched:
        message = min(unmatched)
        side = "received" if message in sends else "sent"
        raise ScheduleError(
            f"the {message} (rank {message.src_rank} -> rank {message.dst_rank}) is never {side}: "
            f"lower the schedule with pipetrain.schedules.lowering.lower"
        )
    sequence = _replay_sends(schedule, comm)
    orders: dict[Pair, list[Message]] = {}
    for message in sorted(sends, key=sequence.__getitem__):
        orders.setdefault(_pair(message), []).append(message)
    return {pair: tuple(messages) for pair, messages in sorted(orders.items())}


def peer_orders(
    orders: Mapping[Pair, tuple[Message, ...]], rank: int
) -> dict[int, tuple[Message, ...]]:
    """The wire orders that concern ``rank``, by peer rank."""
    return {b if a == rank else a: msgs for (a, b), msgs in orders.items() if rank in (a, b)}


def _replay_sends(schedule: Schedule, comm: list[list[Message | None]]) -> dict[Message, int]:
    """The index of each SEND in one unit-cost replay, one action at a time."""
    programs = schedule.actions
    pcs = [0] * len(programs)
    clock = [0] * len(programs)
    sent_at: dict[Message, int] = {}
    sequence: dict[Message, int] = {}
    while True:
        best: tuple[int, int] | None = None
        for rank, row in enumerate(programs):
            pc = pcs[rank]
            if pc == len(row):
                continue
            start = clock[rank]
            message = comm[rank][pc]
            if row[pc].kind in _RECVS:
                assert message is not None
                if message not in sent_at:
                    continue
                start = max(start, sent_at[message])
            if best is None or start < best[0]:
                best = (start, rank)
        if best is None:
            break
        start, rank = best
        action, message = programs[rank][pcs[rank]], comm[rank][pcs[rank]]
        clock[rank] = start + _UNIT_COST.get(action.kind, 0)
        if action.kind in _SENDS:
            assert message is not None
            sent_at[message] = clock[rank]
            sequence[message] = len(sequence)
        pcs[rank] += 1
    if any(pc < len(row) for pc, row in zip(pcs, programs, strict=True)):
        raise _no_order(schedule, comm, pcs)
    return sequence


def _no_order(
    schedule: Schedule, comm: list[list[Message | None]], pcs: list[int]
) -> ScheduleError:
    """The error for a schedule whose replay stopped: a cycle of rules 1 and 2 if there is one."""
    cycle = _rule_cycle(comm)
    if cycle:
        pair = _pair(cycle[0][0])
        chain = "; ".join(f"{why} the {a} before it sends the {b}" for a, b, why in cycle)
        return ScheduleError(
            f"ranks {pair[0]} and {pair[1]} cannot agree on an order of their messages ({chain}): "
            f"the schedule deadlocks; reorder the actions of one of the two ranks"
        )
    stuck = ", ".join(
        f"rank {r} at {row[pc]}"
        for r, (pc, row) in enumerate(zip(pcs, schedule.actions, strict=True))
        if pc < len(row)
    )
    return ScheduleError(
        f"schedule {schedule.name!r} deadlocks ({stuck}): every rank waits for a message "
        f"that is sent later; validate it with pipetrain.schedules.validate"
    )


def _rule_cycle(comm: list[list[Message | None]]) -> list[tuple[Message, Message, str]]:
    """One cycle of rules 1 and 2 as (earlier, later, which rank says so), or []."""
    # after[a][b]: a must precede b, because of what the rank named in the value does.
    after: dict[Message, dict[Message, str]] = {}
    for rank, row in enumerate(comm):
        seen: dict[int, list[Message]] = {}
        for message in row:
            if message is None:
                continue
            mine = message.src_rank == rank
            peer = message.dst_rank if mine else message.src_rank
            if mine:  # every earlier message with this peer goes first (rules 1 and 2)
                for earlier in seen.get(peer, []):
                    how = "sends" if earlier.src_rank == rank else "receives"
                    after.setdefault(earlier, {})[message] = f"rank {rank} {how}"
            seen.setdefault(peer, []).append(message)
    # Peel off messages with nothing left before them (Kahn); what remains lies on cycles
    # or after one. Walking back from a remaining message repeats a message: a cycle.
    preds: dict[Message, set[Message]] = {}
    for a, later in after.items():
        for b in later:
            preds.setdefault(b, set()).add(a)
            preds.setdefault(a, set())
    free = [m for m, p in preds.items() if not p]
    while free:
        node = free.pop()
        for b in after.get(node, {}):
            preds[b].discard(node)
            if not preds[b]:
                free.append(b)
    left = {m: p for m, p in preds.items() if p}
    if not left:
        return []
    walk = [min(left)]
    while walk[-1] not in walk[:-1]:
        walk.append(min(left[walk[-1]]))
    loop = walk[walk.index(walk[-1]) :][::-1]
    return [(a, b, after[a][b]) for a, b in itertools.pairwise(loop)]


# ----------------------------------------------------------------- the NCCL model
@dataclass(frozen=True)
class WireCheck:
    """What ``check_order_matched`` found: ``problem`` is empty when every rank finished."""

    problem: str

    @property
    def ok(self) -> bool:
        return not self.problem


def issue_orders(orders: Mapping[Pair, Sequence[Message]]) -> dict[Pair, tuple[Message, ...]]:
    """Per (rank, peer), what that rank posts: both ranks of a pair post its wire order."""
    issue: dict[Pair, tuple[Message, ...]] = {}
    for (a, b), messages in orders.items():
        issue[(a, b)] = issue[(b, a)] = tuple(messages)
    return issue


class _Stream:
    """What one rank posts to one peer: (message, part) with part 0 the header, 1 the payload."""

    def __init__(self, rank: int, messages: Sequence[Message], headers: bool) -> None:
        parts = (0, 1) if headers else (1,)
        self.ops = [(m, part) for m in messages for part in parts]
        self.sends = [m.src_rank == rank for m, _ in self.ops]
        self.index = {m: i for i, (m, part) in enumerate(self.ops) if part == 1}
        self.posted = 0  # ops handed to the stream
        self.done = 0  # ops completed (a stream runs its ops in order)
        self.ahead = 0  # payload receives posted and not yet taken by a RECV


class _Model:
    """Ranks running their programs over order-matched streams, as in ``check_order_matched``."""

    def __init__(
        self,
        schedule: Schedule,
        issue: Mapping[Pair, Sequence[Message]],
        headers: bool,
        lookahead: int,
    ) -> None:
        self.programs = schedule.actions
        self.comm = _comm(schedule)
        self.headers = headers
        self.lookahead = lookahead
        self.streams = {pair: _Stream(pair[0], msgs, headers) for pair, msgs in issue.items()}
        self.peers: list[list[int]] = [[] for _ in self.programs]
        for rank, peer in sorted(self.streams):
            self.peers[rank].append(peer)
        self.ready: list[set[Message]] = [set() for _ in self.programs]
        self.known: list[set[tuple[int, int, bool]]] = [set() for _ in self.programs]
        self.pcs = [0] * len(self.programs)
        self.moved = False

    def pump(self, rank: int, peer: int, through: int | None) -> bool:
        """Post ops in order: through op ``through`` (forced), or as far as the runtime
        would without blocking (None). False while the host must wait for a header."""
        st = self.streams[(rank, peer)]
        while st.posted < len(st.ops) and (through is None or st.posted <= through):
            message, part = st.ops[st.posted]
            if st.sends[st.posted]:
                if message not in self.ready[rank]:
                    if through is None:
                        return True
                    raise _Broken(f"rank {rank} must post the {message} before its SEND ran")
            elif part == 1 and self.headers:
                if message.boundary not in self.known[rank]:
                    if through is None:
                        return True
                    if st.done < st.posted:
                        return False  # its header has not arrived: the host waits for it
                    self.known[rank].add(message.boundary)
                elif through is None and st.ahead >= self.lookahead:
                    return True
                st.ahead += 1
            st.posted += 1
            self.moved = True
        return True

    def try_action(self, rank: int) -> bool:
        """Run the rank's next action; False while it has to wait."""
        action = self.programs[rank][self.pcs[rank]]
        message = self.comm[rank][self.pcs[rank]]
        if message is None:
            for peer in self.peers[rank]:
                self.pump(rank, peer, None)
            return True
        peer = message.dst_rank if message.src_rank == rank else message.src_rank
        st = self.streams.get((rank, peer))
        if st is None or message not in st.index:
            raise _Broken(f"rank {rank} runs {action} but never posts the {message}")
        where = st.index[message]
        if action.kind in _SENDS:
            self.ready[rank].add(message)
            return self.pump(rank, peer, where) and self.pump(rank, peer, None)
        if not self.pump(rank, peer, where) or st.done <= where:
            return False
        if self.headers:
            st.ahead -= 1
        return True

    def match(self, a: int, b: int) -> None:
        """Complete the ops at the heads of both streams of a pair while they pair up."""
        sa, sb = self.streams[(a, b)], self.streams[(b, a)]
        while sa.done < sa.posted and sb.done < sb.posted:
            op_a, op_b = sa.ops[sa.done], sb.ops[sb.done]
            if op_a != op_b:
                if sa.sends[sa.done] != sb.sends[sb.done]:
                    raise _Broken(
                        f"rank {a} posts {_op(op_a)} while rank {b} posts {_op(op_b)}: the "
                        f"streams pair them up and the data lands in the wrong buffer"
                    )
                return  # two sends or two receives face each other: both wait
            sa.done += 1
            sb.done += 1
            self.moved = True

    def run(self) -> str:
        self.moved = True
        while self.moved:
            self.moved = False
            for rank, row in enumerate(self.programs):
                while self.pcs[rank] < len(row) and self.try_action(rank):
                    self.pcs[rank] += 1
                    self.moved = True
            for a, b in self.streams:
                if a < b:
                    self.match(a, b)
        stuck = [
            f"rank {r} at {row[pc]}"
            for r, (pc, row) in enumerate(zip(self.pcs, self.programs, strict=True))
            if pc < len(row)
        ]
        if stuck:
            return f"deadlock: {', '.join(stuck)}"
        for (a, b), st in self.streams.items():
            if st.done < len(st.ops):
                return (
                    f"rank {a} ends the step with {_op(st.ops[st.done])} to or from rank {b} open"
                )
        return ""


class _Broken(Exception):
    """An issue order that the runtime could not follow at all."""


def _op(op: tuple[Message, int]) -> str:
    return f"the {'header' if op[1] == 0 else 'payload'} of the {op[0]}"


def check_order_matched(
    schedule: Schedule,
    issue: Mapping[Pair, Sequence[Message]],
    *,
    headers: bool = True,
    lookahead: int = 2,
) -> WireCheck:
    """Run a lowered schedule over order-matched streams (NCCL's semantics) in a model.

    ``issue[(rank, peer)]`` is the order in which ``rank`` posts its messages with ``peer``
    (``issue_orders(wire_orders(s))`` for the runtime's). Each rank's posted operations with
    a peer run in order on one stream; the operation at the head completes only together
    with the peer's head when that is its match (a send meets its receive), so two sends or
    two receives facing each other wait, and a send facing another message's receive is
    a mismatch. Hosts never block on a send; a SEND posts its message (it has the data), a
    RECV waits until its message has arrived. With ``headers`` each message is a header
    then a payload, posted as ``DistTransport`` does: a payload receive is posted once its
    shapes are known (a header of the same boundary read earlier in the step) and at most
    ``lookahead`` ahead of use; past that a pump stops, and a SEND or RECV that needs the
    pump further makes its host read the header (blocking) first.
    """
    try:
        problem = _Model(schedule, issue, headers, lookahead).run()
    except _Broken as exc:
        problem = str(exc)
    return WireCheck(problem)
