"""Controllable-memory V schedules (Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024): V-Half and V-Min.

The paper builds a schedule in three moves. A *building block* lays out the passes of one
micro-batch (here ``F``, ``I`` and ``W`` on each of the ``2p`` stages of a V placement:
rank ``r`` holds stage ``r`` on the way down and ``2p-1-r`` on the way back up). The
block is *repeated* every ``T`` time units, one copy per micro-batch, without two passes
of one rank ever colliding. *Squeezing* then removes the idle time that dependencies do
not need; it keeps each rank's order, so a schedule is fully given by the order of the
repeated layout, which is what this module returns (the simulator does the squeezing).

The *lifespan* of a stage in the block is the time from the start of its ``F`` to the end
of its ``W``; a repeated block keeps ``ceil(lifespan / T)`` micro-batches of that stage
alive at once, so the lifespans decide the peak activation memory. On a V placement the
lifespans of a rank's two stages add up to about the same on every rank (the early stage
of rank 0 lives longest, its late stage shortest), which is what lets a V schedule hold
less than 1F1B's ``p`` micro-batches on rank 0.

Units: every pass of one stage takes one slot (the paper's ``F = B = W``, each stage half
of a 1F1B stage), so a rank does ``6`` slots of work per micro-batch and ``T = 6``. The
block walks the V: each ``F`` starts ``forward_offset`` slots after the previous stage's
(1 when both stages are on one rank), the last stage's ``I`` one slot after its ``F``,
each ``I`` ``backward_offset`` slots after the next stage's, and each ``W`` right after its
``I``; a pass whose slot (its time mod ``T``) its rank already uses moves to the next free
slot, so the copies never collide.

- V-Min: every offset 1 (the shortest block). Lifespans about ``4p`` slots, peak
  ``(p+4)//3`` stage-equivalents (``2 ((p+4)//3)`` chunk activations): a third of 1F1B's
  ``p``; bubble about two thirds of 1F1B's.
- V-Half: offset 2 on the way up (chunk 1's forwards), else 1. Lifespans about ``6p``
  slots, peak ``(p+2)//2`` stage-equivalents: half of 1F1B's; bubble between V-Min's and
  ZB-H1's.

These are the peaks of the paper's table (its public demo lists activation memory
``(p+4)//3`` for V-Min and ``(p+2)//2`` for V-Half, against ``p`` for 1F1B); the
simulator reproduces them exactly for p = 2..32 (tests/unit/test_v_schedules.py,
docs/v_schedules.md). The paper's optional reordering of warm-up and cool-down passes is
not applied, so the bubbles are somewhat above its figures (docs/v_schedules.md).

V-Half (top) and V-Min, p = 2, m = 3, ``grid.format_timeline`` of the replay with unit
costs (F = I = W = 1; rank 0 holds stages 0 and 3, rank 1 stages 1 and 2)::

    rank 0 | 0F0 .   .   3F0 3I0 0F1 3W0 .   3F1 3I1 0F2 0I0 0W0 3W1 3F2 3I2 0I1 0W1 3W2 0I2 0W2
    rank 1 | .   1F0 2F0 .   .   2I0 1F1 2F1 1I0 1W0 2W0 2I1 1F2 2F2 1I1 1W1 2W1 2I2 1I2 1W2 2W2

    rank 0 | 0F0 .   .   3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0F2 0I1 0W1 3F2 3I2 3W2 .   0I2 0W2
    rank 1 | .   1F0 2F0 .   .   2I0 1I0 1F1 2F1 1W0 2W0 2I1 1I1 1F2 2F2 1W1 2W1 2I2 1I2 1W2 2W2

Any ``m >= 1`` fits (fewer micro-batches than the block's lifespans only leave more
bubble).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "PERIOD",
    "VBlock",
    "block_peak",
    "building_block",
    "check_v_half",
    "check_v_min",
    "lifespans",
    "v_half",
    "v_min",
]

# Slots of work per micro-batch on one rank: F, I and W of each of its two stages.
PERIOD = 6


@dataclass(frozen=True)
class VBlock:
    """The offsets of a V-shape building block, in slots (see the module doc)."""

    name: str
    # Between the F's of consecutive stages on the way down (chunk 0) and back up (chunk 1).
    forward_down: int
    forward_up: int
    # Between the I's of consecutive stages on the way back (chunk 1, then chunk 0).
    backward_up: int
    backward_down: int


_BLOCKS = {
    "v-min": VBlock("v-min", 1, 1, 1, 1),
    "v-half": VBlock("v-half", 1, 2, 1, 1),
}


def check_v_min(p: int, m: int, v: int = 2) -> str | None:
    return check_basic("v-min", p, m, v)


def check_v_half(p: int, m: int, v: int = 2) -> str | None:
    return check_basic("v-half", p, m, v)


def v_min(p: int, m: int) -> Schedule:
    """V-Min on ``p`` ranks and ``m`` micro-batches: a third of 1F1B's peak activations."""
    raise_if(check_v_min(p, m))
    return _repeat(_BLOCKS["v-min"], p, m)


def v_half(p: int, m: int) -> Schedule:
    """V-Half on ``p`` ranks and ``m`` micro-batches: half of 1F1B's peak activations."""
    raise_if(check_v_half(p, m))
    return _repeat(_BLOCKS["v-half"], p, m)


def building_block(name: str, p: int) -> dict[Action, int]:
    """The start slot of every pass of micro-batch 0 in schedule ``name``'s block."""
    block = _BLOCKS[name]
    placement = Placement.v_shape(p)
    taken: list[set[int]] = [set() for _ in range(p)]
    start: dict[Action, int] = {}

    def put(stage: int, kind: Kind, earliest: int) -> int:
        rank = placement.rank_of(stage)
        slot = earliest
        while slot % PERIOD in taken[rank]:  # a copy of another pass is there: move on
            slot += 1
        taken[rank].add(slot % PERIOD)
        start[Action(stage, kind, 0)] = slot
        return slot

    last = 2 * p - 1
    slot = put(0, Kind.F, 0)
    for stage in range(1, last + 1):
        # Crossing from stage p-1 to p stays on rank p-1: no transfer, offset 1.
        offset = block.forward_down if stage < p else block.forward_up
        slot = put(stage, Kind.F, slot + (1 if stage == p else offset))
    slot = put(last, Kind.I, slot + 1)
    for stage in range(last - 1, -1, -1):
        offset = block.backward_up if stage >= p else block.backward_down
        slot = put(stage, Kind.I, slot + (1 if stage == p - 1 else offset))
    for stage in range(last + 1):
        put(stage, Kind.W, start[Action(stage, Kind.I, 0)] + 1)
    return start


def lifespans(name: str, p: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the lifespans (slots from F's start to W's end) of its two stages in the
    block, (chunk 0, chunk 1)."""
    start = building_block(name, p)

    def life(stage: int) -> int:
        return start[Action(stage, Kind.W, 0)] + 1 - start[Action(stage, Kind.F, 0)]

    return tuple((life(r), life(2 * p - 1 - r)) for r in range(p))


def block_peak(name: str, p: int) -> int:
    """The peak chunk activations the lifespan argument bounds: the worst rank's
    ``sum(ceil(lifespan / PERIOD))`` over its two stages."""
    return max(sum(math.ceil(life / PERIOD) for life in pair) for pair in lifespans(name, p))


def _repeat(block: VBlock, p: int, m: int) -> Schedule:
    """``m`` copies of the block, copy k shifted by ``k * PERIOD``; each rank's actions in
    the order of their start slots (distinct on a rank, so the order is total)."""
    placement = Placement.v_shape(p)
    timed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    for action, slot in building_block(block.name, p).items():
        rank = placement.rank_of(action.stage)
        for k in range(m):
            timed[rank].append((slot + k * PERIOD, Action(action.stage, action.kind, k)))
    rows = [[action for _, action in sorted(row)] for row in timed]
    return Schedule.build(block.name, placement, m, rows)
