"""DualPipeV (DeepSeek-V3's DualPipe, cut in half onto a V placement).

DualPipe runs two pipelines in opposite directions over ``P`` ranks and overlaps the
forward chunk of one micro-batch with the backward chunk of another (so that one's
compute hides the other's communication). Its "V" variant keeps the first half of the
ranks, ``p = P/2``, and folds the two directions into one V: rank ``r`` holds stage ``r``
(chunk 0, on the way down) and stage ``2p-1-r`` (chunk 1, on the way back up), so the
model has ``p_s = 2p`` stages, as many as DualPipe has ranks.

An overlapped pair is written as two consecutive actions of the same rank: the ``F`` of
one chunk, then the ``B`` (or ``I``) of the other. Costs then add up (``F&B = F + B``, no
overlap gain); ``overlapped_pairs`` says which consecutive actions form a pair, and
``dualpipe_v_lowered`` places the messages so that each pair runs as one block.

The published bubble, ``(p_s/2 - 1)(F&B + B - 3W)``, holds with ``p_s = 2p`` stages, i.e.
``(p-1)(F&B + B - 3W)`` on p ranks, when a pair behaves as one block: it starts once both
of its inputs have arrived and both of its outputs leave when it ends, as DualPipe's
runtime receives, computes and then sends. A replay that lets the forward's output leave
as soon as the forward ends, before the paired backward, shortens every rank's wait by
``I`` and gives ``(p-1)(F + B - 2W)`` instead. Peak activations are ``p_s + 1 = 2p + 1``
chunk activations on every rank (one unit = one chunk's activations for one micro-batch).
"""

from __future__ import annotations

from collections import deque

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.lowering import lower, messages_of
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_dualpipe_v", "dualpipe_v", "dualpipe_v_lowered", "overlapped_pairs"]

# One slot of a rank's program: a single action, or an overlapped (forward, backward) pair.
_Slot = tuple[Action, ...]


def check_dualpipe_v(p: int, m: int, v: int = 2) -> str | None:
    basic = check_basic("dualpipe-v", p, m, v)
    if basic is None and m < 2 * p:
        return (
            f"dualpipe-v needs --microbatches >= 2 x --pp (got m={m}, p={p}): use {2 * p} or more"
        )
    return basic


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV on ``p`` ranks and ``m >= 2p`` micro-batches.

    Rank ``r`` (chunk 0 = stage ``r``, chunk 1 = stage ``2p-1-r``; ``F0`` is a forward of
    chunk 0, ``B1`` a backward of chunk 1, ``&`` marks an overlapped pair):

    1. ``2(p-1-r)`` times ``F0``;
    2. ``r+1`` times ``F0 F1``;
    3. ``p-1-r`` times ``I1 W1 F1`` (zero-bubble split, the W right away);
    4. ``m-2p+r+1`` times ``F0&B1  F1&B0`` (on the last rank the first ``F0`` and ``B1``
       run one after the other rather than as a pair, so that the forward need not wait
       for the backward's gradient; DualPipe does this to shrink the bubble);
    5. ``p-1-r`` times ``B1  F1&B0``;
    6. ``r+1`` times ``B1 B0``, where the second half of these backwards are split into
       ``I`` with the ``W`` queued (from the middle pair on, starting with ``B1`` on odd
       ranks and with ``B0`` on even ranks);
    7. ``p-1-r`` times: the oldest queued ``W``, then ``I0`` (its ``W`` queued);
    8. the remaining ``r+1`` queued ``W`` s, oldest first.

    p = 2, m = 4, ``grid.format_timeline`` of the replay with unit costs (F = I = W = 1,
    B = 2)::

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3B1 3F2 0B0 0B0 3B2 3B2 3F3 .   0B1 0B1 3B3 3B3 0I2 0W2 0I3 0W3
        rank 1 | .   1F0 2F0 1F1 2F1 1F2 2B0 2B0 2F2 1B0 1B0 1F3 2B1 2B1 2F3 1B1 1B1 2B2 2B2 1B2 1B2 2I3 1I3 2W3 1W3

    The same programs as text, overlapped pairs in brackets::

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 [0F3 3B1] [3F2 0B0] 3B2 [3F3 0B1] 3B3 0I2 0W2 0I3 0W3
        rank 1 | 1F0 2F0 1F1 2F1 1F2 2B0 [2F2 1B0] [1F3 2B1] [2F3 1B1] 2B2 1B2 2I3 1I3 2W3 1W3
    """
    rows = [[a for slot in slots for a in slot] for slots in _rank_slots_all(p, m)]
    return Schedule.build("dualpipe-v", Placement.v_shape(p), m, rows)


def dualpipe_v_lowered(p: int, m: int) -> Schedule:
    """``dualpipe_v(p, m)`` with its sends and receives placed as DualPipe runs a pair.

    Both receives of an overlapped pair come before it and both sends after it: the pair
    starts when the activation of its forward and the gradient of its backward have both
    arrived, and neither output leaves before the pair ends. Every other message goes where
    ``lowering.lower`` puts it (right before or after its compute). Replaying this
    schedule gives the published bubble ``(p-1)(F&B + B - 3W)``.
    """
    placement = Placement.v_shape(p)
    rows = []
    for slots in _rank_slots_all(p, m):
        placed: list[Action] = []
        for slot in slots:
            if len(slot) == 2:
                forward, backward = slot
                f_receives, f_sends = messages_of(forward, placement)
                b_receives, b_sends = messages_of(backward, placement)
                placed.extend(f_receives + b_receives)
                placed.extend(slot)
                placed.extend(f_sends + b_sends)
            else:
                placed.extend(slot)
        rows.append(placed)
    return lower(Schedule.build("dualpipe-v", placement, m, rows))


def overlapped_pairs(p: int, m: int) -> tuple[frozenset[int], ...]:
    """Per rank, the positions in ``dualpipe_v(p, m)`` where an overlapped pair starts
    (the pair is that action and the next)."""
    result = []
    for slots in _rank_slots_all(p, m):
        starts = set()
        position = 0
        for slot in slots:
            if len(slot) == 2:
                starts.add(position)
            position += len(slot)
        result.append(frozenset(starts))
    return tuple(result)


class _Rank:
    """Builds one rank's program: micro-batch counters per chunk and the queue of split
    backwards whose W is still to run (first in, first out, like DualPipe's store)."""

    def __init__(self, p: int, r: int) -> None:
        self.stages = (r, 2 * p - 1 - r)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.pending_w: deque[Action] = deque()
        self.slots: list[_Slot] = []

    def forward(self, chunk: int) -> Action:
        action = Action(self.stages[chunk], Kind.F, self.forwards[chunk])
        self.forwards[chunk] += 1
        return action

    def backward(self, chunk: int, split: bool = False) -> Action:
        stage, k = self.stages[chunk], self.backwards[chunk]
        self.backwards[chunk] += 1
        if not split:
            return Action(stage, Kind.B, k)
        self.pending_w.append(Action(stage, Kind.W, k))
        return Action(stage, Kind.I, k)

    def run(self, action: Action) -> None:
        """An action on its own."""
        self.slots.append((action,))

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        """An overlapped pair: forward of one chunk with a full backward of the other."""
        self.slots.append((self.forward(forward_chunk), self.backward(backward_chunk)))

    def weight(self) -> None:
        self.slots.append((self.pending_w.popleft(),))


def _rank_slots_all(p: int, m: int) -> list[list[_Slot]]:
    """Every rank's program as slots, after checking the constraints."""
    raise_if(check_dualpipe_v(p, m))
    return [_rank_slots(p, m, r) for r in range(p)]


def _rank_slots(p: int, m: int, r: int) -> list[_Slot]:
    """Rank r's program as slots (see ``dualpipe_v`` for the eight phases)."""
    b = _Rank(p, r)
    last_rank = r == p - 1
    for _ in range(2 * (p - 1 - r)):
        b.run(b.forward(0))
    for _ in range(r + 1):
        b.run(b.forward(0))
        b.run(b.forward(1))
    for _ in range(p - 1 - r):
        b.run(b.backward(1, split=True))
        b.weight()
        b.run(b.forward(1))
    for i in range(m - 2 * p + r + 1):
        if i == 0 and last_rank:
            b.run(b.forward(0))
            b.run(b.backward(1))
        else:
            b.pair(0, 1)
        b.pair(1, 0)
    for _ in range(p - 1 - r):
        b.run(b.backward(1))
        b.pair(1, 0)
    # Split the second half of the last backwards, so that their W's fill the drain.
    half = (r + 1) // 2
    for i in range(r + 1):
        b.run(b.backward(1, split=i > half or (i == half and r % 2 == 1)))
        b.run(b.backward(0, split=i >= half))
    for _ in range(p - 1 - r):
        b.weight()
        b.run(b.backward(0, split=True))
    while b.pending_w:
        b.weight()
    return b.slots
