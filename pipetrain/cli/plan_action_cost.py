"""What one action costs beyond its layers, fitted on a pipelined reference run (torch-free).

The profile times layers, and the calibration's references (pp = 1) scale them to real
runs, but a pipeline runs many more actions a step than those references: interleaved 1F1B
over 2 ranks with 4 stages each runs 4x the F and B of one process at the same micro-batch
size. Each action costs the executor, autograd's entry and, where the processes share the
cores, a switch between them; on llama-default at 2 processes the layouts with 32 to 96
actions a process measured 10-30% over their predictions where those with 2 to 8 met
theirs (BENCHMARKS.md, the ninth sweep). So a reference with many actions, at the micro-
batch size of a calibrated one, is measured too, and the seconds an action that make its
prediction meet its run are charged to every action of every layout
(``Hardware.per_action``). Where the pp = 1 references cannot reach a micro-batch size the
search ranks, a pipelined reference with few actions at that size sets the factor on the
compute there (``fit_size_factor``). docs/plan_auto.md has the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.partition.layouts import AutoRequest, Layout, Scored
from pipetrain.partition.scoring import Scorer

__all__ = [
    "Reference",
    "fit_per_action",
    "fit_size_factor",
    "pipelined_references",
    "reference_factors",
]

# Bisection steps on the seconds an action: 2^-40 of the range, far below any noise.
_STEPS = 40
# The range a size reference's factor is sought in: a profile off by more than 10x is
# not one to calibrate.
_FACTOR_RANGE = (0.1, 10.0)


@dataclass(frozen=True)
class Reference:
    """A reference layout's prediction before calibration and its measured step (seconds,
    the median run)."""

    predicted: Scored
    step: float
    # Seconds a step its slowest pipeline rank waited for the dp all-reduce after its
    # pipeline (the median run); None where the runs reported none (no replicas).
    dp_wait: float | None = None


def pipelined_references(request: AutoRequest, like: Layout) -> tuple[Layout, ...]:
    """Interleaved 1F1B over 2 ranks, every other process a replica, at the micro-batch size
    of ``like`` (a pp = 1 reference): 4 stages a rank, then 2 for a model too short to
    cut in 8 (the caller takes the first that it can simulate); () where the processes do
    not pair up."""
    world = request.world_size
    if world % 2 or like.pp != 1:
        return ()
    # Half the replicas, each with twice the micro-batches: the same size as ``like``.
    m = 2 * like.microbatches
    return tuple(Layout("interleaved-1f1b", 2, world // 2, 1, v, m, False, False) for v in (4, 2))


def reference_factors(references: Sequence[Reference], scorer: Scorer) -> dict[int, float]:
    """Micro-batch size -> the factor on the profile's compute that makes each pp = 1
    reference's prediction meet its run once each of its actions costs what ``scorer``'s
    hardware says (``scorer``: the profile's costs). The step's all-reduce and update keep
    their modelled times; a tenth of the step at least is compute."""
    factors = {}
    for ref in references:
        predicted = ref.predicted
        own = scorer.rescore(predicted).pipeline_time - predicted.pipeline_time
        compute = ref.step - predicted.dp_time - predicted.update_time - own
        factors[scorer.microbatch_size(predicted.layout)] = (
            max(compute, 0.1 * ref.step) / predicted.pipeline_time
        )
    return factors


def fit_per_action(
    references: Sequence[Reference],
    pipelined: Reference,
    score: Callable[[dict[int, float], float], Scorer],
) -> tuple[float, dict[int, float]]:
    """(seconds an action, the references' factors at it): the cost per action at which
    the pipelined reference's prediction, with the pp = 1 references' compute refitted,
    meets its measured step; 0 where even none predicts it slower than measured.
    ``score(factors, per_action)``: a scorer with the profile's costs scaled by
    ``factors`` (by micro-batch size; {}: unscaled) and that cost per action."""

    def predicted(per_action: float) -> tuple[float, dict[int, float]]:
        factors = reference_factors(references, score({}, per_action))
        return score(factors, per_action).rescore(pipelined.predicted).step_time, factors

    at_zero, factors = predicted(0.0)
    if at_zero >= pipelined.step:
        return 0.0, factors
    # No action costs more than the whole measured step shared over a rank's actions.
    lo, hi = 0.0, pipelined.step / _actions_per_rank(pipelined.predicted.layout)
    at_hi, factors = predicted(hi)
    if at_hi <= pipelined.step:
        return hi, factors
    lo, hi = _bisect(lambda x: predicted(x)[0], pipelined.step, lo, hi)
    return lo, predicted(lo)[1]


def fit_size_factor(
    reference: Reference,
    factors: dict[int, float],
    per_action: float,
    score: Callable[[dict[int, float], float], Scorer],
) -> tuple[int, float]:
    """(the reference's micro-batch size, the factor on the profile's compute there at
    which its prediction meets its measured step), the other sizes' ``factors`` and the
    cost an action kept; the factor is clamped to ``_FACTOR_RANGE``. ``score`` as for
    ``fit_per_action``."""
    size = score({}, per_action).microbatch_size(reference.predicted.layout)

    def predicted(factor: float) -> float:
        scorer = score({**factors, size: factor}, per_action)
        return scorer.rescore(reference.predicted).step_time

    lo, hi = _FACTOR_RANGE
    if predicted(lo) >= reference.step:
        return size, lo
    if predicted(hi) <= reference.step:
        return size, hi
    lo, hi = _bisect(predicted, reference.step, lo, hi)
    return size, (lo + hi) / 2


def _bisect(
    predicted: Callable[[float], float], step: float, lo: float, hi: float
) -> tuple[float, float]:
    """The bracket (lo, hi) around the value at which ``predicted``, rising in it, meets
    ``step``, narrowed ``_STEPS`` times from ``lo`` (below it) and ``hi`` (above)."""
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < step else (lo, mid)
    return lo, hi


def _actions_per_rank(layout: Layout) -> int:
    """An F and a B per micro-batch and stage of a rank (no split backward)."""
    return 2 * layout.microbatches * layout.chunks
