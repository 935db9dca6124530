"""Lowering: add the sends and receives that a compute-only schedule leaves implicit.

For each edge between stages on different ranks:

- ``SEND_F(s, k)`` right after ``F(s, k)`` when ``next(s)`` is on another rank;
- ``RECV_F(s, k)`` right before ``F(s, k)`` when ``prev(s)`` is on another rank;
- ``SEND_B(s, k)`` right after ``B(s, k)`` or ``I(s, k)`` when ``prev(s)`` is on another rank;
- ``RECV_B(s, k)`` right before ``B(s, k)`` or ``I(s, k)`` when ``next(s)`` is on another rank.

Edges between stages on the same rank (interleaved neighbours, the turn of a V) get no
messages. A message that the schedule already has is kept where it is, so lowering is
idempotent and a hand-placed send or receive survives.

Order of messages: between a pair of ranks, sends leave in the sender's compute order and
receives are posted in the receiver's compute order. On a link that carries only
activations one way and gradients the other (GPipe, 1F1B, interleaved 1F1B as generated
here) the two orders agree. They can differ when one link carries both in the same
direction, as on a V placement: with p = 2, rank 0 sends rank 1 the activations of stage 0
and the gradients of stage 3, and may send ``0F1``'s activation before ``3B0``'s gradient
while rank 1 runs ``2B0`` (receiving that gradient) before ``1F1`` (ZB-V does this). So
neither side's program order can be the order of the wire. NCCL matches messages between
two ranks only by the order in which they are posted (tags are ignored), so the runtime
posts every pair's messages in one order that both ranks derive from the lowered schedule
(``pipetrain.schedules.wire``; on gloo each direction keeps its part of it), checks each message's header against the name it expects
there, and uses one tag for all messages on every backend.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.deps import BACKWARD_INPUT_KINDS
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["lower", "messages_of"]


def _crosses(placement: Placement, stage: int, other: int | None) -> bool:
    return other is not None and placement.rank_of(other) != placement.rank_of(stage)


def messages_of(action: Action, placement: Placement) -> tuple[list[Action], list[Action]]:
    """The receives that go before ``action`` and the sends that go after it: what
    ``lower`` places around each compute action, and what a schedule that places its
    messages by hand (``dualpipe.dualpipe_v_lowered``) places around its pairs."""
    s, mb = action.stage, action.microbatch
    if mb is None or s >= placement.num_stages:
        return [], []
    prev, nxt = placement.prev_stage(s), placement.next_stage(s)
    if action.kind is Kind.F:
        before = [Action(s, Kind.RECV_F, mb)] if _crosses(placement, s, prev) else []
        after = [Action(s, Kind.SEND_F, mb)] if _crosses(placement, s, nxt) else []
        return before, after
    if action.kind in BACKWARD_INPUT_KINDS:
        before = [Action(s, Kind.RECV_B, mb)] if _crosses(placement, s, nxt) else []
        after = [Action(s, Kind.SEND_B, mb)] if _crosses(placement, s, prev) else []
        return before, after
    return [], []


def lower(schedule: Schedule) -> Schedule:
    """The same schedule with every cross-rank send and receive placed (see module doc)."""
    rows: list[tuple[Action, ...]] = []
    for row in schedule.actions:
        present = {a for a in row if a.is_comm}
        lowered: list[Action] = []
        for action in row:
            before, after = messages_of(action, schedule.placement)
            lowered.extend(a for a in before if a not in present)
            lowered.append(action)
            lowered.extend(a for a in after if a not in present)
        rows.append(tuple(lowered))
    return Schedule(
        schedule.name,
        schedule.placement,
        schedule.microbatches,
        tuple(rows),
        schedule.asynchronous,
        schedule.params,
    )
