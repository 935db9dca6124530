"""GPipe (Huang et al. 2019): all forwards, then all backwards, a flush per step.

Rank r runs the forward of every micro-batch through stage r, then every backward, in the
same micro-batch order (the first micro-batch in is the first out, so its activations are
freed first). Bubble ``(p-1)(F+B)``; every rank holds the activations of all m
micro-batches at its peak.

p = 3, m = 4 (unit costs F = 1, B = 2)::

    rank 0 | 0F0 0F1 0F2 0F3 .   .   .   .   .   .   0B0 0B0 0B1 0B1 0B2 0B2 0B3 0B3
    rank 1 | .   1F0 1F1 1F2 1F3 .   .   .   1B0 1B0 1B1 1B1 1B2 1B2 1B3 1B3
    rank 2 | .   .   2F0 2F1 2F2 2F3 2B0 2B0 2B1 2B1 2B2 2B2 2B3 2B3
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_gpipe", "gpipe"]


def check_gpipe(p: int, m: int, v: int = 1) -> str | None:
    return check_basic("gpipe", p, m, v)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe on ``p`` ranks (linear placement) with ``m`` micro-batches."""
    raise_if(check_gpipe(p, m))
    rows = [
        [Action(r, Kind.F, k) for k in range(m)] + [Action(r, Kind.B, k) for k in range(m)]
        for r in range(p)
    ]
    return Schedule.build("gpipe", Placement.linear(p), m, rows)
