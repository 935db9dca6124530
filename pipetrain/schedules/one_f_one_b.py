"""1F1B, also PipeDream-Flush (Narayanan et al. 2021): one forward, one backward.

Rank r runs ``p-1-r`` warm-up forwards, then alternates one forward and one backward, then
drains the remaining ``p-1-r`` backwards. Same bubble as GPipe, ``(p-1)(F+B)``, but rank r
holds at most ``p-r`` micro-batches of activations instead of m. Needs ``m >= p`` (with
fewer micro-batches the steady phase never starts and GPipe is the same thing).

p = 3, m = 4 (unit costs F = 1, B = 2)::

    rank 0 | 0F0 0F1 0F2 .   .   .   .   0B0 0B0 0F3 0B1 0B1 .   0B2 0B2 .   0B3 0B3
    rank 1 | .   1F0 1F1 .   .   1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2 .   1B3 1B3
    rank 2 | .   .   2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_one_f_one_b", "one_f_one_b", "one_f_one_b_order"]


def check_one_f_one_b(p: int, m: int, v: int = 1) -> str | None:
    basic = check_basic("1f1b", p, m, v)
    if basic is None and m < p:
        return (
            f"1f1b needs --microbatches >= --pp (got m={m}, p={p}): raise --microbatches to "
            f"{p} or more, or use gpipe"
        )
    return basic


def one_f_one_b_order(
    p: int, rank: int, m: int, warmup: int | None = None
) -> list[tuple[Kind, int]]:
    """Rank ``rank``'s 1F1B order of ``(F or B, micro-batch)`` over ``m`` micro-batches.

    ``warmup`` forwards (default ``p-1-rank``) precede the first backward. Shared with
    PipeDream, which streams the same order, and Chimera, which warms up less.
    """
    warmup = min(p - 1 - rank if warmup is None else warmup, m)
    order = [(Kind.F, k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [(Kind.F, warmup + k), (Kind.B, k)]
    order += [(Kind.B, k) for k in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B on ``p`` ranks (linear placement) with ``m >= p`` micro-batches."""
    raise_if(check_one_f_one_b(p, m))
    rows = [[Action(r, kind, k) for kind, k in one_f_one_b_order(p, r, m)] for r in range(p)]
    return Schedule.build("1f1b", Placement.linear(p), m, rows)
