"""Chimera (Li & Hoefler 2021): two pipelines in opposite directions on the same ranks.

Placement ``bidirectional``: the *down* pipeline (replica 0) puts model stage j on rank j,
the *up* pipeline (replica 1) on rank p-1-j, so rank r holds model stages r and p-1-r and
every stage has two replicas whose gradients are summed by an ``ALLREDUCE`` before the
(implicit) optimizer step. Where one pipeline's ramp-up leaves a rank idle, the other's
fills it: the bubble shrinks from 1F1B's ``(p-1)(F+B)`` to about ``(p/2-1)(F+B)``.

How micro-batches split: the first ``ceil(m/2)`` go down, the rest go up.

How a rank interleaves its two stages: each pipeline alone runs 1F1B, except that a stage
in the first half of the model (j < p/2) warms up with one forward fewer (``p-2-j``
instead of ``p-1-j``), so that the two stages of a rank together hold at most p
micro-batches' activations (plain 1F1B on both would reach p+1). Rank r merges its two
programs in the order of the start times they would have alone (unit costs), a forward
before a backward at equal times, then the stage further along its pipeline first (it
feeds ranks that wait; for p = 4, m = 4 this reaches makespan 16, the least that an
exhaustive search over these programs finds). The all-reduces come last, the higher model
stage first (its gradients are complete earlier), the same order on both replicas' ranks.

Measured with unit costs (F = 1, B = 2), m >= p: makespan
``m(F+B) + (p/2-1)(F+B) + (p/2-1)F``, so a bubble of ``(p/2-1)(2F+B)`` per rank; peak
activations from ``p/2+1`` on the end ranks to ``p`` in the middle for ``m = p``, ``p`` on
every rank for larger m.
"""

from __future__ import annotations

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.constraints import check_basic, raise_if
from pipetrain.schedules.execution import replay
from pipetrain.schedules.one_f_one_b import one_f_one_b_order
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["check_chimera", "chimera"]


def check_chimera(p: int, m: int, v: int = 1) -> str | None:
    basic = check_basic("chimera", p, m, v)
    if basic is not None:
        return basic
    if p % 2:
        # The even neighbours of p; p = 1 has only one ("use 2 or 2" read as a typo).
        fix = f"{p + 1} or {p - 1}" if p > 1 else "2"
        return f"chimera needs an even --pp (got p={p}): use {fix}"
    if m < 2:
        return (
            f"chimera needs --microbatches >= 2 (got m={m}): one or more for each of its two "
            "pipelines"
        )
    return None


def _order(p: int, j: int, n: int) -> list[tuple[Kind, int]]:
    """Model stage j's order over its pipeline's n micro-batches (see the module doc)."""
    return one_f_one_b_order(p, j, n, warmup=max(0, p - 1 - j - (j < p // 2)))


def _alone_start_times(p: int, n: int) -> dict[tuple[Kind, int, int], float]:
    """Start time of (kind, model stage, k-th micro-batch) for one pipeline alone."""
    rows = [[Action(j, kind, k) for kind, k in _order(p, j, n)] for j in range(p)]
    timeline = replay(Schedule.build("1f1b", Placement.linear(p), n, rows))
    return {
        (e.action.kind, e.action.stage, e.action.microbatch or 0): e.start for e in timeline.events
    }


def chimera(p: int, m: int) -> Schedule:
    """Chimera on ``p`` (even) ranks with ``m >= 2`` micro-batches (see the module doc).

    p = 4, m = 4: stages 0-3 down (micro-batches 0, 1), stages 4-7 up (2, 3); rank r holds
    stages r and 7-r (unit costs F = 1, B = 2, all-reduce free)::

        rank 0 | 0F0 0F1 .   7F2 7B2 7B2 7F3 7B3 7B3 .   0B0 0B0 .   .   0B1 0B1
        rank 1 | .   1F0 6F2 1F1 6F3 .   6B2 6B2 1B0 1B0 6B3 6B3 1B1 1B1
        rank 2 | .   5F2 2F0 5F3 2F1 .   2B0 2B0 5B2 5B2 2B1 2B1 5B3 5B3
        rank 3 | 4F2 4F3 .   3F0 3B0 3B0 3F1 3B1 3B1 .   4B2 4B2 .   .   4B3 4B3

    The programs, all-reduces last::

        rank 0 | 0F0 0F1 7F2 7B2 7F3 7B3 0B0 0B1 7ALLREDUCE 0ALLREDUCE
        rank 1 | 1F0 6F2 1F1 6F3 6B2 1B0 6B3 1B1 6ALLREDUCE 1ALLREDUCE
        rank 2 | 5F2 2F0 5F3 2F1 2B0 5B2 2B1 5B3 2ALLREDUCE 5ALLREDUCE
        rank 3 | 4F2 4F3 3F0 3B0 3F1 3B1 4B2 4B3 3ALLREDUCE 4ALLREDUCE
    """
    raise_if(check_chimera(p, m))
    placement = Placement.bidirectional(p)
    half = (m + 1) // 2
    groups = (list(range(half)), list(range(half, m)))
    alone = [_alone_start_times(p, len(group)) for group in groups]
    rows = []
    for r in range(p):
        keyed = []
        for replica, group in enumerate(groups):
            j = r if replica == 0 else p - 1 - r
            for kind, k in _order(p, j, len(group)):
                start = alone[replica][(kind, j, k)]
                action = Action(replica * p + j, kind, group[k])
                keyed.append(((start, kind is Kind.B, -j), action))
        keyed.sort(key=lambda item: item[0])
        row = [action for _, action in keyed]
        by_model_stage = sorted(placement.stages_of(r), key=placement.model_stage, reverse=True)
        row += [Action(stage, Kind.ALLREDUCE) for stage in by_model_stage]
        rows.append(row)
    return Schedule.build("chimera", placement, m, rows)
