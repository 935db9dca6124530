"""What a pipeline is built from: the device, the split into stages, the schedule.

Small pure helpers of ``build_pipeline``, kept apart so that the API module holds only the
pipeline itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from pipetrain.models import PipelineSpec
from pipetrain.runtime.errors import PipelineInputError
from pipetrain.schedules import Kind, Schedule
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.validate import validate

__all__ = ["as_spec", "default_device", "even_split", "forward_only", "resolve_schedule"]


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def even_split(num_layers: int, num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer ranges, as equal as possible, the larger ones first."""
    if num_stages > num_layers:
        raise PipelineInputError(
            f"the schedule has {num_stages} model stages but the model only {num_layers} layers: "
            f"use fewer ranks or chunks, or a model with more layers (n_layers)"
        )
    base, extra = divmod(num_layers, num_stages)
    split, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        split.append(tuple(range(start, start + size)))
        start += size
    return tuple(split)


def resolve_schedule(
    schedule: str | Schedule, ranks: int, microbatches: int, chunks: int | None
) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.num_ranks != ranks:
            raise PipelineInputError(
                f"schedule {schedule.name!r} is for {schedule.num_ranks} ranks but the pipeline group has "
                f"{ranks}: launch {schedule.num_ranks} processes or load a schedule for {ranks}"
            )
        # A whole-batch schedule (naive) runs one micro-batch whatever was asked for.
        if schedule.microbatches not in (microbatches, 1):
            raise PipelineInputError(
                f"schedule {schedule.name!r} has {schedule.microbatches} micro-batches but microbatches="
                f"{microbatches}: pass microbatches={schedule.microbatches}"
            )
        built = schedule
    else:
        from pipetrain.schedules.registry import build_schedule

        built = build_schedule(schedule, ranks, microbatches, chunks=chunks)
    validate(built)
    lowered = lower(built)
    validate(lowered)
    return lowered


def forward_only(schedule: Schedule) -> Schedule:
    """The forward actions of a schedule, in its order (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    return Schedule(schedule.name + "/forward", schedule.placement, schedule.microbatches, rows)


def as_spec(model: PipelineSpec | Sequence[Any]) -> PipelineSpec:
    if isinstance(model, PipelineSpec):
        return model
    if isinstance(model, (list, tuple)):
        return PipelineSpec.from_layers(model)
    raise PipelineInputError(
        f"model is a {type(model).__name__}: pass a PipelineSpec (pipetrain.models.model_spec) or a list of layer factories"
    )
