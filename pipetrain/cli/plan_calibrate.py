"""``plan --auto --balance profile`` on a CPU: short real runs calibrate the profile.

The profile times layers and the whole model's step in as many processes as the run has,
but the level of a real run's compute still differs from it (BENCHMARKS.md: at four
processes on two cores, 1.15x to 1.3x between two profiles of the same model, every layout
of a sweep off by the same factor to within a few per cent; at two processes 0.95-1.05x),
and so can its shape over the micro-batch size (the seventh sweep's profile put micro-batch
4 a quarter slower a sample than 8). So after the profile, layouts without a bubble and
with few messages (pp = 1, every process a data-parallel replica) train for a few steps
through the real launcher, a few times each, at two micro-batch sizes; the all-reduce of
their replicas is refitted to the waits they measured (``plan_links``), and every layer's
compute at a size is scaled by the median run's compute over the predicted one there
(between the two sizes the factor follows the logarithm of the size, beyond them the
nearest's holds). A third reference, interleaved 1F1B over 2 ranks at the smaller size, runs 4x
(or 2x) the actions a process of the first: the seconds an action that make its prediction
meet its run are charged to every action of every layout (``plan_action_cost``). Where a
replica's share of the batch is under 16, GPipe over 2 ranks at one micro-batch of twice
that share (``size_reference``) sets the factor at its size. What the
processes of the first three held beyond the count refits the workspace (a fraction of the
micro-batch in flight and bytes a process) that every layout is charged. The shape
of the predictions within one size stays the profile's; the scale becomes the runs'.
docs/plan_auto.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Callable
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.plan_action_cost import (
    Reference,
    fit_per_action,
    fit_size_factor,
    pipelined_references,
    reference_factors,
)
from pipetrain.cli.plan_links import refit_allreduce
from pipetrain.cli.plan_measure import measure_layout, measure_top
from pipetrain.models.config import ModelConfig
from pipetrain.partition.layer_costs import LayerCost, scaled_times
from pipetrain.partition.layouts import AutoRequest, CostsFor, Hardware, Layout, Scored
from pipetrain.partition.memory import fit_line
from pipetrain.partition.scoring import Scorer

__all__ = [
    "add_calibrate_flags",
    "calibrate",
    "calibrate_for",
    "check_calibrate_flags",
    "factor_at",
    "reference_layouts",
    "size_reference",
]

# The micro-batch sizes the references prefer: those the planner's winners use here
# (4 to 16 on the sweeps of BENCHMARKS.md).
_PREFERRED_SIZES = (4, 16)


def reference_layouts(request: AutoRequest) -> tuple[Layout, ...]:
    """pp = 1, dp = every process, at the micro-batch counts whose sizes are nearest 4 and
    nearest 16 (one layout where they are the same); () where the batch does not split
    over the processes."""
    world, batch = request.world_size, request.batch_size
    if batch % world:
        return ()
    local = batch // world
    counts = [m for m in range(1, local + 1) if local % m == 0]
    picked = [min(counts, key=lambda c: (abs(local // c - size), c)) for size in _PREFERRED_SIZES]
    return tuple(Layout("1f1b", 1, world, 1, 1, m, False, False) for m in dict.fromkeys(picked))


def size_reference(request: AutoRequest) -> Layout | None:
    """GPipe over 2 stages (1F1B's order at one micro-batch, which 1F1B refuses), half the
    processes its replicas, at one micro-batch of a replica's share of the batch (twice a
    pp = 1 reference's largest), where the pp = 1 share is under the larger preferred
    size; else None. The search ranks such micro-batches (the fastest layouts of
    llama-default at 4 processes run them), and beyond the largest reference the factor
    of the nearest holds, which the profile's shape put 10% off there (BENCHMARKS.md, the
    seventeenth sweep)."""
    world, batch = request.world_size, request.batch_size
    if world % 2 or batch % world or batch // world >= _PREFERRED_SIZES[-1]:
        return None
    return Layout("gpipe", 2, world // 2, 1, 1, 1, False, False)


def factor_at(factors: dict[int, float], size: int) -> float:
    """The calibration factor at micro-batch ``size`` from those measured at some sizes:
    on the straight line in the logarithm of the size between the two around it, the
    nearest's beyond them."""
    sizes = sorted(factors)
    if size <= sizes[0]:
        return factors[sizes[0]]
    if size >= sizes[-1]:
        return factors[sizes[-1]]
    hi = next(s for s in sizes if s >= size)
    lo = max(s for s in sizes if s < size)
    weight = math.log(size / lo) / math.log(hi / lo)
    return factors[lo] + weight * (factors[hi] - factors[lo])


def add_calibrate_flags(p: argparse.ArgumentParser) -> None:
    """``plan --auto``'s flags of the calibration run."""
    p.add_argument(
        "--calibrate-steps",
        type=int,
        default=8,
        metavar="S",
        help="with --auto --balance profile on a CPU: train reference layouts (pp 1, every "
        "process a replica, micro-batches near 4 and 16) S steps and scale the profiled "
        "compute to them (default 8; 0: none)",
    )
    p.add_argument(
        "--calibrate-runs",
        type=int,
        default=3,
        metavar="R",
        help="with --calibrate-steps: runs of each reference, the median counted (default 3)",
    )


def check_calibrate_flags(args: argparse.Namespace) -> None:
    if args.calibrate_steps != 0 and args.calibrate_steps < 2:
        raise UsageError(
            f"--calibrate-steps must be 0 (none) or >= 2 (the first step is not timed), "
            f"got {args.calibrate_steps}"
        )
    if args.calibrate_runs < 1:
        raise UsageError(f"--calibrate-runs must be >= 1, got {args.calibrate_runs}")


def calibrate_for(
    args: argparse.Namespace,
    config: ModelConfig,
    request: AutoRequest,
    costs_for: CostsFor,
    hw: Hardware,
    overrides_of: Callable[[Scored, AutoRequest], dict[str, Any]],
    *,
    say: Callable[[str], None],
) -> tuple[CostsFor, Hardware, str]:
    """``calibrate`` as ``plan --auto --balance profile`` asks it: on a CPU whose cores
    the processes share, with more than one process and ``--calibrate-steps`` > 0
    (elsewhere the profile stands: on a GPU the run would be a cluster job, which
    ``--measure K`` is)."""
    if not (hw.shared_cores and args.calibrate_steps and request.world_size > 1):
        return costs_for, hw, ""
    say(
        f"calibrating: reference layouts train {args.calibrate_steps} steps, "
        f"{args.calibrate_runs} times each"
    )
    return calibrate(
        config, config.name, request, costs_for, hw, steps=args.calibrate_steps,
        runs=args.calibrate_runs, measure=measure_layout, overrides_of=overrides_of, say=say,
    )  # fmt: skip


def calibrate(
    config: ModelConfig,
    model: str,
    request: AutoRequest,
    costs_for: CostsFor,
    hw: Hardware,
    *,
    steps: int,
    measure: Callable[..., Any],
    overrides_of: Callable[[Scored, AutoRequest], dict[str, Any]],
    runs: int = 3,
    say: Callable[[str], None] = lambda _line: None,
) -> tuple[CostsFor, Hardware, str]:
    """``costs_for`` with its compute scaled to real runs of ``reference_layouts``, ``hw``
    with the seconds an action costs beyond its layers (fitted on a pipelined reference,
    ``plan_action_cost``) and the bytes a process holds beyond the profile's step, and a
    line saying what was measured (or why nothing was). ``hw`` is a profile's (no fixed
    part per layer: every second of the pipeline is in the costs scaled). ``runs`` runs of
    ``steps`` steps per reference: the median run counts, as runs of one layout here differ
    by up to a third (BENCHMARKS.md). ``measure``: ``plan_measure.measure_layout``; ``overrides_of``: a
    layout's config fields; ``say``: the runs' progress."""
    layouts = reference_layouts(request)
    if not layouts:
        return costs_for, hw, "; not calibrated (the batch does not split over the processes)"
    free = dataclasses.replace(request, memory_limit=None)
    scorer = Scorer(config, free, costs_for, hw)
    said: list[str] = []
    predictions = []
    for layout in layouts:
        predicted = scorer.evaluate(layout)
        if predicted is None or predicted.pipeline_time <= 0:
            said.append(f"not by {layout.describe()} (it cannot be simulated)")
        else:
            predictions.append(predicted)
    piped = _pipelined(scorer, predictions)
    sized = _simulable(scorer, size_reference(request))
    runs_of = predictions + piped + sized
    # Alternating (a, b, a, b, ...): a machine that drifts moves every reference alike.
    done = measure_top(
        runs_of * runs, request, overrides_of, model=model, steps=steps, say=say,
        measure=measure,
    )  # fmt: skip
    references, measured = _medians(runs_of, done, steps, said)
    plain = [ref for ref in references if ref.predicted not in piped + sized]
    many = [ref for ref in references if ref.predicted in piped]  # the pipelined one, timed
    wide = [ref for ref in references if ref.predicted in sized]
    if not plain:
        return costs_for, hw, "; not calibrated: " + "; ".join(said)
    # The replicas' waits first: what is left of each step is the compute to fit.
    hw, links_said = refit_allreduce(hw, references)
    if links_said:
        scorer = Scorer(config, free, costs_for, hw)
        plain, many, wide = (
            [_rescored(scorer, ref) for ref in refs] for refs in (plain, many, wide)
        )

    def scorer_at(factors: dict[int, float], per_action: float) -> Scorer:
        scaled = _scaled(costs_for, factors) if factors else costs_for
        return Scorer(config, free, scaled, dataclasses.replace(hw, per_action=per_action))

    per_action, factors, action_said = _fitted_compute(plain, many, wide, scorer, scorer_at)
    said.append(
        "compute x " + ", ".join(f"{factors[s]:.2f} at micro-batch {s}" for s in sorted(factors))
    )
    between = " (between the sizes by the logarithm of the size)" if len(factors) > 1 else ""
    # The workspace is fitted on the references the sweeps checked it against; the size
    # reference is timed only.
    measured = [(predicted, ok) for predicted, ok in measured if predicted not in sized]
    hw, memory_said = _calibrated_memory(dataclasses.replace(hw, per_action=per_action), measured)
    return (
        _scaled(costs_for, factors), hw,
        "; calibrated " + "; ".join(said) + between + action_said + links_said + memory_said,
    )  # fmt: skip


def _fitted_compute(
    plain: list[Reference],
    many: list[Reference],
    wide: list[Reference],
    scorer: Scorer,
    scorer_at: Callable[[dict[int, float], float], Scorer],
) -> tuple[float, dict[int, float], str]:
    """(the seconds an action, the factor on the compute by micro-batch size, the line on
    the cost an action): the replicas' factors, with the cost an action where the
    pipelined reference ran, and the size reference's factor at its size."""
    per_action, factors = 0.0, reference_factors(plain, scorer)
    action_said = ""
    if many:
        per_action, factors = fit_per_action(plain, many[0], scorer_at)
        action_said = (
            f"; each action (F, B, I or W) {per_action * 1e3:.2f} ms beyond its layers, "
            f"which {many[0].predicted.layout.describe()} measured"
        )
    if wide:
        # Fitted last: the other references' sizes are all below it, so it moves none of
        # their factors, and it runs 2 actions a rank, so the cost an action hardly moves it.
        size, factor = fit_size_factor(wide[0], factors, per_action, scorer_at)
        factors = {**factors, size: factor}
    return per_action, factors, action_said


def _rescored(scorer: Scorer, ref: Reference) -> Reference:
    return dataclasses.replace(ref, predicted=scorer.rescore(ref.predicted))


def _medians(
    runs_of: list[Scored], done: list[Any], steps: int, said: list[str]
) -> tuple[list[Reference], list[tuple[Scored, list[Any]]]]:
    """Each reference's median step over its runs that trained (``done`` alternates over
    ``runs_of``), and those runs; what was measured, or why not, added to ``said``."""
    references, measured = [], []
    for i, predicted in enumerate(runs_of):
        mine = done[i :: len(runs_of)]
        ok = [run for run in mine if run.ok and run.step_time > 0]
        if not ok:
            failed = next((run.error for run in mine if run.error), "no step timed")
            said.append(f"not by {predicted.layout.describe()} (failed: {failed[:80]})")
            continue
        waits = [max(run.dp_wait) for run in ok if run.dp_wait]
        references.append(
            Reference(
                predicted,
                statistics.median(run.step_time for run in ok),
                statistics.median(waits) if waits else None,
            )
        )
        measured.append((predicted, ok))
        said.append(
            f"by {predicted.layout.describe()}: predicted {predicted.step_time * 1e3:.0f} ms, "
            f"measured {_listed(run.step_time * 1e3 for run in ok)} ms over {steps} steps "
            f"(median of {len(ok)} runs)"
        )
    return references, measured


def _pipelined(scorer: Scorer, predictions: list[Scored]) -> list[Scored]:
    """The pipelined reference, at the size of the references' smallest micro-batch, that
    the model can be simulated under: [it], or [] (none; the processes do not pair up)."""
    if not predictions:
        return []
    smallest = max(predictions, key=lambda p: p.layout.microbatches).layout
    for layout in pipelined_references(scorer.req, smallest):
        if found := _simulable(scorer, layout):
            return found
    return []


def _simulable(scorer: Scorer, layout: Layout | None) -> list[Scored]:
    """[``layout`` scored] where there is one and it can be simulated, else []."""
    scored = scorer.evaluate(layout) if layout is not None else None
    return [scored] if scored is not None and scored.pipeline_time > 0 else []


def _scaled(costs_for: CostsFor, factors: dict[int, float]) -> CostsFor:
    """``costs_for`` with every layer's compute at a micro-batch size scaled by
    ``factor_at`` that size."""

    def calibrated(tp: int, mb: int) -> list[LayerCost]:
        return scaled_times(costs_for(tp, mb), factor_at(factors, mb))

    return calibrated


def _calibrated_memory(
    hw: Hardware, measured: list[tuple[Scored, list[Any]]]
) -> tuple[Hardware, str]:
    """``hw`` with the workspace refitted on the references' runs: what the fullest
    process held beyond its count without a workspace (weights, gradients, optimizer
    state, saved activations, buffers), the median per reference, against the bytes in
    flight of its prediction. References whose bytes in flight differ fit the fraction
    and the bytes per process (``fit_line``); one keeps the profile's fraction and fits
    the bytes. The pipelined reference counts with the replicas: most layouts a search
    ranks are pipelines, whose heaps keep more beyond the count than a replica's whose
    gradients are views of its buckets (BENCHMARKS.md, the seventeenth sweep). A real
    run's process holds what the profile's one-process step does not (its data, the
    replicas' reducer, the communicators, the heap it does not give back,
    docs/memory_model.md); the recomputing workspace moves by the same bytes."""
    points = []
    for predicted, runs in measured:
        beyond: list[float] = []
        in_flight: list[float] = []
        for run in (run for run in runs if run.measured_peak):
            peaks = run.measured_peak
            # Processes in the launcher's order, pipeline rank first (pp-major).
            counted = [predicted.memory[i * len(predicted.memory) // len(peaks)]
                       for i in range(len(peaks))]  # fmt: skip
            fullest = max(range(len(peaks)), key=lambda i: peaks[i])
            beyond.append(peaks[fullest] - (counted[fullest].total - counted[fullest].workspace))
            in_flight.append(counted[fullest].in_flight)
        if beyond:
            # Each run's fullest process may be another rank: the medians of both.
            points.append((statistics.median(in_flight), statistics.median(beyond)))
    if not points:
        return hw, "; memory not calibrated (the runs measured no peak)"
    fraction, per_process = hw.memory_overhead
    if len({x for x, _ in points}) > 1:
        new_fraction, new_bytes = fit_line(points)
    else:
        new_fraction = fraction
        new_bytes = max(0.0, statistics.median(y - fraction * x for x, y in points))
    r_fraction, r_per_process = hw.recompute_overhead
    hw = dataclasses.replace(
        hw,
        memory_overhead=(new_fraction, new_bytes),
        recompute_overhead=(r_fraction, max(0.0, r_per_process + new_bytes - per_process)),
    )
    return hw, (
        f"; a process held beyond the count {_listed(y / 2**20 for _, y in points)} MiB "
        f"(median per reference): workspace {new_fraction:.0%} of the micro-batch in flight "
        f"and {new_bytes / 2**20:.1f} MiB a process (the profile's step: {fraction:.0%} and "
        f"{per_process / 2**20:.1f} MiB)"
    )


def _listed(values: Any) -> str:
    return ", ".join(f"{v:.0f}" for v in values)
