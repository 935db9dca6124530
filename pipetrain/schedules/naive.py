"""Naive model parallelism: the whole batch goes through the stages one after another.

No micro-batching: the batch is one micro-batch, so only one rank works at a time and the
idle fraction is ``(p-1)/p``. It is the baseline the pipelined schedules improve on.
The registry marks it ``whole_batch``: simulators scale its per-micro-batch costs by the
``m`` micro-batches that the batch stands for.

p = 3 (unit costs F = 1, B = 2)::

    rank 0 | 0F0 .   .   .   .   .   .   0B0 0B0
    rank 1 | .   1F0 .   .   .   1B0 1B0
    rank 2 | .   .   2F0 2B0 2B0
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_naive", "naive"]


def check_naive(p: int, m: int, v: int = 1) -> str | None:
    return check_basic("naive", p, m, v)


def naive(p: int, m: int = 1) -> Schedule:
    """Stage r on rank r; one forward and one backward of the whole batch per rank.

    ``m`` is accepted for a uniform signature and ignored: the batch is not split.
    """
    raise_if(check_naive(p, m))
    rows = [[Action(r, Kind.F, 0), Action(r, Kind.B, 0)] for r in range(p)]
    return Schedule.build("naive", Placement.linear(p), 1, rows)
