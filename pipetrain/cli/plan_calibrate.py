"""``plan --auto --balance profile`` on a CPU: one short real run calibrates the profile.

The profile times layers and the whole model's step in as many processes as the run has,
but the level of a real run's compute still differs from it (BENCHMARKS.md: at four
processes on two cores, 1.15x to 1.3x between two profiles of the same model, every layout
of a sweep off by the same factor to within a few per cent; at two processes 0.95-1.05x).
So after the profile, one layout without a bubble and with few messages (pp = 1, every
process a data-parallel replica) trains for a few steps through the real launcher, and
every layer's compute is scaled by its measured step's compute over the predicted one.
The shape of the predictions (which layout is faster, by how much) stays the profile's;
the scale becomes the run's. docs/plan_auto.md has the figures.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrain.models.config import ModelConfig
from pipetrain.partition.layer_costs import LayerCost, scaled_times
from pipetrain.partition.layouts import AutoRequest, CostsFor, Hardware, Layout, Scored
from pipetrain.partition.scoring import Scorer

__all__ = ["calibrate", "reference_layout"]

# The micro-batch size the reference prefers: the sizes the planner's winners use here.
_PREFERRED_SIZE = 4


def reference_layout(request: AutoRequest) -> Layout | None:
    """pp = 1, dp = every process, the micro-batch count whose size is nearest 4; None
    where the batch does not split over the processes."""
    world, batch = request.world_size, request.batch_size
    if batch % world:
        return None
    local = batch // world
    counts = [m for m in range(1, local + 1) if local % m == 0]
    m = min(counts, key=lambda c: (abs(local // c - _PREFERRED_SIZE), c))
    return Layout("1f1b", 1, world, 1, 1, m, False, False)


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
) -> tuple[CostsFor, str]:
    """``costs_for`` with its compute scaled to a real run of ``reference_layout``, and
    a line saying what was measured (or why nothing was). ``hw`` is a profile's (no fixed
    part per layer: every second of the pipeline is in the costs scaled). ``measure``:
    ``plan_measure.measure_layout``; ``overrides_of``: a layout's config fields."""
    layout = reference_layout(request)
    if layout is None:
        return costs_for, "; not calibrated (the batch does not split over the processes)"
    scored = Scorer(config, dataclasses.replace(request, memory_limit=None), costs_for, hw)
    predicted = scored.evaluate(layout)
    if predicted is None or predicted.pipeline_time <= 0:
        return costs_for, f"; not calibrated ({layout.describe()} cannot be simulated)"
    with tempfile.TemporaryDirectory(prefix="pipetrain-calibrate-") as tmp:
        run = measure(
            predicted,
            overrides_of(predicted, request),
            model=model,
            steps=steps,
            out_dir=Path(tmp),
            name="reference",
        )
    if not run.ok or not run.step_time > 0:
        return costs_for, f"; not calibrated ({layout.describe()} failed: {run.error[:80]})"
    # The step's all-reduce and update keep their measured links; the rest is compute.
    compute = run.step_time - predicted.dp_time - predicted.update_time
    factor = max(compute, 0.1 * run.step_time) / predicted.pipeline_time

    def calibrated(tp: int, mb: int) -> list[LayerCost]:
        return scaled_times(costs_for(tp, mb), factor)

    said = (
        f"; calibrated by {layout.describe()}: predicted {predicted.step_time * 1e3:.0f} ms, "
        f"measured {run.step_time * 1e3:.0f} ms over {steps} steps, compute x {factor:.2f}"
    )
    return calibrated, said
