"""Asynchronous pipelines without a flush: PipeDream and PipeDream-2BW.

Both stream ``m x steps`` micro-batches through the 1F1B order (rank r: ``p-1-r`` warm-up
forwards, then one forward and one backward, a drain only at the very end of the stream)
and create new weight versions with ``STEP`` actions inside the stream
(``Schedule.asynchronous``). ``Schedule.microbatches`` is the number streamed; the params
record ``window`` (m) and ``steps``.

- PipeDream (Narayanan et al. 2019): a ``STEP(s, k)`` right after every backward ``B(s, k)``.
  With weight stashing each forward records the version current when it runs and its
  backward uses the same one; rank r keeps ``p-r`` versions alive.
- PipeDream-2BW (Narayanan et al. 2021): gradients accumulate over windows of m
  micro-batches; a ``STEP`` follows the backward that completes each window, so there are
  at most two versions (double buffering) and updates are one step stale.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.one_f_one_b import one_f_one_b_order
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_pipedream", "check_pipedream_2bw", "pipedream", "pipedream_2bw"]


def check_pipedream(p: int, m: int, v: int = 1, steps: int = 2) -> str | None:
    basic = check_basic("pipedream", p, m, v)
    if basic is None and steps < 1:
        return f"pipedream needs steps >= 1 (got {steps}): stream at least one window"
    if basic is None and m * steps < p:
        need = -(-p // steps)
        return (
            f"pipedream streams --microbatches x {steps} micro-batches and needs at least --pp "
            f"of them to fill the pipeline (got m={m}, p={p}): raise --microbatches to {need}"
        )
    return basic


def check_pipedream_2bw(p: int, m: int, v: int = 1, steps: int = 2) -> str | None:
    basic = check_basic("pipedream-2bw", p, m, v)
    if basic is None and steps < 1:
        return f"pipedream-2bw needs steps >= 1 (got {steps}): stream at least one window"
    if basic is None and m < p:
        return (
            f"pipedream-2bw needs --microbatches >= --pp (got m={m}, p={p}): raise "
            f"--microbatches to {p} or more (a window of m micro-batches per weight version)"
        )
    return basic


def _stream(name: str, p: int, m: int, steps: int, step_after: int) -> Schedule:
    """1F1B over ``m x steps`` micro-batches, a STEP after every ``step_after``-th backward."""
    total = m * steps
    rows = []
    for r in range(p):
        row = []
        for kind, k in one_f_one_b_order(p, r, total):
            row.append(Action(r, kind, k))
            if kind is Kind.B and k % step_after == step_after - 1:
                row.append(Action(r, Kind.STEP, k))
        rows.append(row)
    return Schedule.build(
        name,
        Placement.linear(p),
        total,
        rows,
        asynchronous=True,
        params={"window": m, "steps": steps},
    )


def pipedream(p: int, m: int, steps: int = 2) -> Schedule:
    """PipeDream over ``m x steps`` streamed micro-batches: a new version after each backward.

    p = 3, m = 2, steps = 2 (unit costs F = 1, B = 2, STEP free, so not drawn)::

        rank 0 | 0F0 0F1 0F2 .   .   .   .   0B0 0B0 0F3 0B1 0B1 .   0B2 0B2 .   0B3 0B3
        rank 1 | .   1F0 1F1 .   .   1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2 .   1B3 1B3
        rank 2 | .   .   2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3

    The programs, with the STEPs::

        rank 0 | 0F0 0F1 0F2    0B0    0STEP0 0F3    0B1    0STEP1 0B2    0STEP2 0B3 0STEP3
        rank 1 | 1F0 1F1 1B0    1STEP0 1F2    1B1    1STEP1 1F3    1B2    1STEP2 1B3 1STEP3
        rank 2 | 2F0 2B0 2STEP0 2F1    2B1    2STEP1 2F2    2B2    2STEP2 2F3    2B3 2STEP3
    """
    raise_if(check_pipedream(p, m, steps=steps))
    return _stream("pipedream", p, m, steps, step_after=1)


def pipedream_2bw(p: int, m: int, steps: int = 2) -> Schedule:
    """PipeDream-2BW over ``m x steps`` micro-batches: a new version every m backwards.

    p = 3, m = 3, steps = 2 (unit costs F = 1, B = 2, STEP free, so not drawn)::

        rank 0 | 0F0 0F1 0F2 .   .   .   .   0B0 0B0 0F3 0B1 0B1 0F4 0B2 0B2 0F5 0B3 0B3 .   0B4 0B4 .   0B5 0B5
        rank 1 | .   1F0 1F1 .   .   1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2 1F4 1B3 1B3 1F5 1B4 1B4 .   1B5 1B5
        rank 2 | .   .   2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3 2F4 2B4 2B4 2F5 2B5 2B5

    The programs, with the STEPs::

        rank 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0F4    0B2    0STEP2 0F5 0B3 0B4 0B5 0STEP5
        rank 1 | 1F0 1F1 1B0 1F2 1B1 1F3 1B2    1STEP2 1F4    1B3 1F5 1B4 1B5 1STEP5
        rank 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2STEP2 2F3    2B3    2F4 2B4 2F5 2B5 2STEP5
    """
    raise_if(check_pipedream_2bw(p, m, steps=steps))
    return _stream("pipedream-2bw", p, m, steps, step_after=m)
