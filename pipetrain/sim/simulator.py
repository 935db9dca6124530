"""The simulator: replay a schedule under per-stage costs and measure what came out.

The timing is the reference replay of ``pipetrain.schedules.execution`` (the same engine
the validator uses), so a schedule that simulates is one that runs. This module adds the
accounting: busy and idle time, the three bubbles, live activations and weight versions,
in bytes when sizes are given. ``analyse`` does the accounting alone, for timelines
measured by the runtime.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.acks import gradient_acks
from pipetrain.schedules.execution import Costs, Timeline, replay
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.schedule import Schedule
from pipetrain.sim.metrics import (
    Bubble,
    bubble,
    peak_activation_bytes,
    peak_activations,
    peak_with_gradients,
    rank_times,
    stage_weight_versions,
    weight_versions,
)

__all__ = ["SimResult", "SizeError", "analyse", "scale_costs", "simulate"]


class SizeError(InputError):
    """Byte sizes that do not match the placement's model stages."""


@dataclass(frozen=True)
class SimResult:
    """What one schedule does under one set of costs. Tuples are indexed by rank."""

    timeline: Timeline
    microbatches: int
    # Stages per rank (v): 1 for linear placements, 2 for V and Chimera placements.
    chunks: int
    makespan: float
    busy: tuple[float, ...]
    # Idle against the whole makespan, and inside each rank's own first-to-last span.
    idle: tuple[float, ...]
    span_idle: tuple[float, ...]
    bubble: Bubble
    # In units of one stage's activations for one micro-batch (a chunk when v > 1).
    peak_activations: tuple[int, ...]
    weight_versions: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...] | None = None
    # Bytes of every weight version held at once, summed over the rank's stages.
    weight_bytes: tuple[float, ...] | None = None
    # Optimizer steps the timeline covers: asynchronous schedules stream several.
    steps: int = 1
    # The most bytes of activations and weight gradients (with the dp buckets) live at once,
    # where gradient sizes were given (``metrics.peak_with_gradients``).
    peak_with_gradient_bytes: tuple[float, ...] | None = None

    @property
    def schedule(self) -> str:
        return self.timeline.name

    @property
    def time_per_step(self) -> float:
        return self.makespan / self.steps

    @property
    def num_ranks(self) -> int:
        return self.timeline.num_ranks

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (no events): the ``pipetrain simulate --json`` object."""
        out: dict[str, Any] = {
            "schedule": self.schedule,
            "pp": self.num_ranks,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "makespan": self.makespan,
            "steps": self.steps,
            "time_per_step": self.time_per_step,
            "bubble": {
                "idle_fraction": self.bubble.idle_fraction,
                "over_ideal": self.bubble.over_ideal,
                "per_rank_span": self.bubble.per_rank_span_fraction,
                "per_rank_span_time": self.bubble.per_rank_span_time,
                "idle_time": self.bubble.idle_time,
            },
            "busy": list(self.busy),
            "idle": list(self.idle),
            "span_idle": list(self.span_idle),
            "peak_activations": list(self.peak_activations),
            "weight_versions": list(self.weight_versions),
        }
        if self.peak_activation_bytes is not None:
            out["peak_activation_bytes"] = list(self.peak_activation_bytes)
        if self.weight_bytes is not None:
            out["weight_bytes"] = list(self.weight_bytes)
        if self.peak_with_gradient_bytes is not None:
            out["peak_with_gradient_bytes"] = list(self.peak_with_gradient_bytes)
        return out


def _per_model_stage(
    value: float | Sequence[float], placement: Placement, what: str
) -> list[float]:
    """One number per virtual stage from a scalar or one number per model stage."""
    if isinstance(value, (int, float)):
        return [float(value)] * placement.num_stages
    if len(value) != placement.num_model_stages:
        raise SizeError(
            f"{what}: give one number or one per model stage "
            f"({placement.num_model_stages}), got {len(value)}"
        )
    return [float(value[placement.model_stage(s)]) for s in range(placement.num_stages)]


@functools.lru_cache(maxsize=64)
def gradient_releases(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int, bool]]:
    """(stage, micro-batch) of each backward whose input gradient goes to another rank ->
    (stage, micro-batch, is a backward) of the action on that rank whose incoming message
    proves the gradient arrived, where one does (``pipetrain.schedules.acks``, on the
    schedule as the runtime lowers it)."""
    releases: dict[tuple[int, int], tuple[int, int, bool]] = {}
    for by_message in gradient_acks(lower(schedule)).values():
        for got, gradients in by_message.items():
            for gradient in gradients:
                releases[(gradient.src_stage, gradient.microbatch)] = (
                    got.dst_stage, got.microbatch, got.is_grad,
                )  # fmt: skip
    return releases


def _sends_to_another_rank(placement: Placement, stage: int) -> bool:
    """Whether ``stage``'s backward sends its input gradient to another rank."""
    prev = placement.prev_stage(stage)
    return prev is not None and placement.rank_of(prev) != placement.rank_of(stage)


def analyse(
    timeline: Timeline,
    *,
    placement: Placement,
    microbatches: int,
    chunks: int | None = None,
    activation_bytes: float | Sequence[float] | None = None,
    weight_bytes: float | Sequence[float] | None = None,
    batch_scale: int = 1,
    steps: int = 1,
    deferred_bytes: float | Sequence[float] | None = None,
    freed_bytes: float | Sequence[float] | None = None,
    sent_bytes: float | None = None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None = None,
    gradient_bytes: Sequence[float] | None = None,
    bucket_bytes: Sequence[float] | None = None,
) -> SimResult:
    """The accounting of ``timeline``, simulated or measured, covering ``steps`` optimizer
    steps.

    ``activation_bytes`` and ``weight_bytes`` are per model stage (or one number for all):
    the activations one micro-batch leaves on a stage, and the stage's parameters.
    ``deferred_bytes`` (per model stage, or one number): what one micro-batch's split
    backward holds from its I to its W besides (counted with the activations);
    ``freed_bytes`` (likewise), the part of its activations that the end of its I lets go.
    ``sent_bytes``: one micro-batch's message between stages; each backward's input
    gradient sent to another rank counts with the activations until ``acks`` says it
    arrived (``metrics.live_activations``; ``gradient_releases`` of the schedule), or the
    step ends.
    ``batch_scale`` is how many micro-batches one action carries (m for the naive
    schedule, which runs the whole batch at once): activations count that many units.
    ``gradient_bytes`` and ``bucket_bytes`` (per model stage): its weight gradients and the
    flat copies its data-parallel all-reduce sums, for the peak of both with the
    activations (``metrics.peak_with_gradients``).
    """
    times = rank_times(timeline)
    act_bytes = joint = None
    if activation_bytes is not None:
        act_bytes, joint = _activation_peaks(
            timeline, placement, activation_bytes, batch_scale, deferred_bytes, freed_bytes,
            sent_bytes, acks, gradient_bytes, bucket_bytes,
        )  # fmt: skip
    held = None
    if weight_bytes is not None:
        sizes = _per_model_stage(weight_bytes, placement, "weight_bytes")
        per_rank = [0.0] * timeline.num_ranks
        for stage, versions in stage_weight_versions(timeline).items():
            per_rank[placement.rank_of(stage)] += versions * sizes[stage]
        held = tuple(per_rank)
    return SimResult(
        timeline=timeline,
        microbatches=microbatches,
        chunks=placement.stages_per_rank if chunks is None else chunks,
        makespan=timeline.makespan,
        busy=times.busy,
        idle=times.idle,
        span_idle=times.span_idle,
        bubble=bubble(timeline, times),
        peak_activations=tuple(batch_scale * n for n in peak_activations(timeline)),
        weight_versions=weight_versions(timeline),
        peak_activation_bytes=act_bytes,
        weight_bytes=held,
        peak_with_gradient_bytes=joint,
        steps=steps,
    )


def _activation_peaks(
    timeline: Timeline,
    placement: Placement,
    activation_bytes: float | Sequence[float],
    batch_scale: int,
    deferred_bytes: float | Sequence[float] | None,
    freed_bytes: float | Sequence[float] | None,
    sent_bytes: float | None,
    acks: Mapping[tuple[int, int], tuple[int, int, bool]] | None,
    gradient_bytes: Sequence[float] | None,
    bucket_bytes: Sequence[float] | None,
) -> tuple[tuple[float, ...], tuple[float, ...] | None]:
    """``analyse``'s peak of activation bytes per rank, and of activations with gradients
    where ``gradient_bytes`` are given (else None)."""
    sizes = _per_model_stage(activation_bytes, placement, "activation_bytes")
    held_back = early = None
    if deferred_bytes is not None:
        pending = _per_model_stage(deferred_bytes, placement, "deferred_bytes")
        held_back = [batch_scale * h for h in pending]
    if freed_bytes is not None:
        freed = _per_model_stage(freed_bytes, placement, "freed_bytes")
        early = [batch_scale * f for f in freed]
    sent = None
    if sent_bytes:
        sent = [
            batch_scale * sent_bytes if _sends_to_another_rank(placement, v) else 0.0
            for v in range(placement.num_stages)
        ]
    live = ([batch_scale * s for s in sizes], held_back, early, sent, acks)
    if gradient_bytes is None:
        return peak_activation_bytes(timeline, *live), None
    grads = _per_model_stage(gradient_bytes, placement, "gradient_bytes")
    flat = _per_model_stage(bucket_bytes or [0.0] * len(gradient_bytes), placement, "bucket_bytes")
    return peak_activation_bytes(timeline, *live), peak_with_gradients(timeline, grads, flat, *live)


def _scaled(value: float | tuple[float, ...], factor: float) -> float | tuple[float, ...]:
    if isinstance(value, tuple):
        return tuple(factor * v for v in value)
    return factor * value


def scale_costs(costs: Costs, factor: float) -> Costs:
    """``costs`` with every compute duration (F, B, I, W) times ``factor``."""
    return replace(
        costs,
        forward=_scaled(costs.forward, factor),
        backward=_scaled(costs.backward, factor),
        backward_input=_scaled(costs.backward_input, factor),
        backward_weight=_scaled(costs.backward_weight, factor),
    )


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    activation_bytes: float | Sequence[float] | None = None,
    weight_bytes: float | Sequence[float] | None = None,
    batch_scale: int = 1,
    deferred_bytes: float | Sequence[float] | None = None,
    freed_bytes: float | Sequence[float] | None = None,
    sent_bytes: float | None = None,
    gradient_bytes: Sequence[float] | None = None,
    bucket_bytes: Sequence[float] | None = None,
) -> SimResult:
    """Replay ``schedule`` under ``costs`` (default: unit costs) and measure it (see ``analyse``).

    ``batch_scale`` multiplies compute costs and activations: pass m for a schedule whose
    actions each carry the whole batch (naive model parallel) to compare it fairly with
    micro-batched ones. Raises ``ScheduleError`` when the schedule deadlocks.
    """
    costs = Costs() if costs is None else costs  # the papers' unit costs
    timeline = replay(schedule, scale_costs(costs, batch_scale) if batch_scale != 1 else costs)
    params = dict(schedule.params)
    # Asynchronous schedules stream several windows of m micro-batches; report m.
    window = params.get("window", schedule.microbatches)
    return analyse(
        timeline,
        placement=schedule.placement,
        microbatches=window * batch_scale,
        chunks=params.get("v"),
        activation_bytes=activation_bytes,
        weight_bytes=weight_bytes,
        batch_scale=batch_scale,
        steps=params.get("steps", 1),
        deferred_bytes=deferred_bytes,
        freed_bytes=freed_bytes,
        sent_bytes=sent_bytes,
        acks=gradient_releases(schedule) if sent_bytes else None,
        gradient_bytes=gradient_bytes,
        bucket_bytes=bucket_bytes,
    )
