"""A model of NCCL's order-matched streams that runs a schedule against per-rank issue orders.

``check_order_matched`` runs a schedule against per-rank issue orders in a model of those
NCCL streams (``pipetrain.schedules.wire`` says why the order matters), with the runtime's
header and look-ahead rules; the tests use it to show that every built-in schedule
completes with ``wire_orders`` and that bad orders fail.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.schedules.messages import SEND_KINDS, Message, Pair, message_of
from pipetrain.schedules.schedule import Schedule

__all__ = ["WireCheck", "check_order_matched", "issue_orders"]


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
    """What one rank posts to one peer: (message, part) with part 0 the header, 1 the payload
    (with ``packed``, all but the first message of a boundary are one op: both in one buffer)."""

    def __init__(self, rank: int, messages: Sequence[Message], headers: bool, packed: bool) -> None:
        self.ops: list[tuple[Message, int]] = []
        announced: set[tuple[int, int, bool]] = set()
        for m in messages:
            if headers and not (packed and m.boundary in announced):
                self.ops.append((m, 0))
            announced.add(m.boundary)
            self.ops.append((m, 1))
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
        packed: bool,
    ) -> None:
        self.programs = schedule.actions
        self.comm = [[message_of(a, schedule) for a in row] for row in self.programs]
        self.headers = headers
        self.lookahead = lookahead
        self.streams = {
            pair: _Stream(pair[0], msgs, headers, packed) for pair, msgs in issue.items()
        }
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
            elif part == 0 and message.boundary in self.known[rank]:
                # A later message's header goes with its payload, within the look-ahead.
                if through is None and st.ahead >= self.lookahead:
                    return True
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
        if action.kind in SEND_KINDS:
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
    packed: bool = True,
) -> WireCheck:
    """Run a lowered schedule over order-matched streams (NCCL's semantics) in a model.

    ``issue[(rank, peer)]`` is the order in which ``rank`` posts its messages with ``peer``
    (``issue_orders(wire_orders(s))`` for the runtime's). Each rank's posted operations with
    a peer run in order on one stream; the operation at the head completes only together
    with the peer's head when that is its match (a send meets its receive), so two sends or
    two receives facing each other wait, and a send facing another message's receive is
    a mismatch. Hosts never block on a send; a SEND posts its message (it has the data), a
    RECV waits until its message has arrived. With ``headers`` each message is a header
    then a payload, posted as ``DistTransport`` does, and with ``packed`` the later
    messages of a boundary are one packed operation each (the transport packs small ones):
    the first header of a boundary is posted as soon as the pump reaches it; everything
    else once the boundary's shapes are known (that header read earlier in the step) and
    at most ``lookahead`` ahead of use; past that a pump stops, and a SEND or RECV that
    needs the pump further makes its host read the header (blocking) first. (In a later
    step the transport posts a first message with the shapes it guesses from the step
    before: in the same place in the order, its payload only posted earlier; a guess that
    misses puts a filler before the payload, in the same place too.)
    """
    try:
        problem = _Model(schedule, issue, headers, lookahead, packed).run()
    except _Broken as exc:
        problem = str(exc)
    return WireCheck(problem)
