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

The messages themselves are defined in ``pipetrain.schedules.messages``; the model of the
NCCL streams that checks an order (``check_order_matched``) is in
``pipetrain.schedules.wire_check`` and re-exported here.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from pipetrain.schedules.actions import Kind
from pipetrain.schedules.messages import (
    RECV_KINDS,
    SEND_KINDS,
    Message,
    Pair,
    PeerOrders,
    message_of,
)
from pipetrain.schedules.schedule import Schedule, ScheduleError
from pipetrain.schedules.wire_check import WireCheck, check_order_matched, issue_orders

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

# Unit costs of the replay that orders the messages (messages are free).
_UNIT_COST = {Kind.F: 1, Kind.B: 2, Kind.I: 1, Kind.W: 1}


def _comm(schedule: Schedule) -> list[list[Message | None]]:
    """For each rank and position, the message of that action (None for compute)."""
    return [[message_of(a, schedule) for a in row] for row in schedule.actions]


def _pair(message: Message) -> Pair:
    a, b = message.src_rank, message.dst_rank
    return (a, b) if a < b else (b, a)


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
            if row[pc].kind in RECV_KINDS:
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
        if action.kind in SEND_KINDS:
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
