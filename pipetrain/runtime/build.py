"""Building a pipeline: ``build_pipeline`` checks its arguments, prepares the schedule
(``pipetrain.schedules.prepare``, unless the caller prepared it), builds this process's
stages of the model and connects them (``pipetrain.runtime.wiring``).

The pipeline itself and its step are ``pipetrain.runtime.api``'s; this module depends on
it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.models import PipelineSpec, StageModule, build_stage
from pipetrain.models.layer_check import check_layers
from pipetrain.runtime.api import Pipeline
from pipetrain.runtime.errors import PipelineInputError
from pipetrain.runtime.executor import PipelineHooks
from pipetrain.runtime.inputs import (
    as_spec,
    as_split,
    check_counts,
    even_split,
    resolve_device,
)
from pipetrain.runtime.loss import reduced_loss
from pipetrain.runtime.stage import LossFn
from pipetrain.runtime.transport import backend_for
from pipetrain.runtime.wiring import wire
from pipetrain.schedules import Schedule
from pipetrain.schedules.prepare import PreparedSchedule, is_schedule_file, prepare_schedule

__all__ = ["build_pipeline", "resolve_schedule"]

# What ``build_pipeline(schedule=)`` takes: a built-in name or a schedule file, a
# ``Schedule`` of the caller's own, or one already prepared (``pipetrain train``'s plan).
ScheduleSource = str | Schedule | PreparedSchedule


def build_pipeline(
    model: PipelineSpec | Sequence[Any],
    *,
    schedule: ScheduleSource,
    microbatches: int,
    chunks: int | None = None,
    group: Any = None,
    ranks: int | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    split: Sequence[Sequence[int]] | None = None,
    loss_fn: LossFn | None = None,
    loss_reduction: str | None = None,
    timeout_s: float = 300.0,
    dtype: torch.dtype = torch.float32,
    hooks: PipelineHooks | None = None,
    early_grads: bool = True,
) -> Pipeline:
    """Build this rank's stages of ``model`` for ``schedule``.

    ``schedule``: a built-in's name or a CSV or JSON schedule file, prepared here
    (``pipetrain.schedules.prepare``); a ``Schedule``, validated and lowered here; or a
    ``PreparedSchedule``, run as it is. ``group``: the pipeline's process group (its size
    is the number of pipeline ranks); None runs all ``ranks`` in this process (debug
    mode). ``split``: layer indices of each model stage (default: ``even_split``).
    ``loss_fn(logits, targets)`` returns the loss of a micro-batch, summed over its
    targets (``loss_reduction="sum"``) or their mean (``loss_reduction="mean"``): a
    ``loss_fn`` without ``loss_reduction`` is refused (``pipetrain.runtime.loss``; a
    cross-entropy given with the other reduction is refused at the first step). ``hooks``: the
    caller's code run inside a step (``PipelineHooks``: the STEP actions of asynchronous
    schedules, a weight version before each compute, data parallelism's all-reduce once
    a stage's gradients are final). Every wait gives up after ``timeout_s`` seconds.
    ``early_grads``: a schedule given by name splits the backwards that another rank waits
    for into I and W, and sends the input gradient between them
    (``pipetrain.schedules.early_grads``: the same order of F, B and I, a W in place or
    moved to the end of its rank, the same gradients to rounding; 1F1B's cool-down and
    GPipe's turn shorter); False runs the named schedule's Bs whole.
    """
    spec = as_spec(model)
    _check_options(microbatches, ranks, chunks, seed, timeout_s, dtype)
    loss = reduced_loss(loss_fn, loss_reduction)
    names = check_layers(spec)  # every rank: the same one-line error for any layer
    dev = resolve_device(device)
    num_ranks, local_ranks = _pipeline_ranks(schedule, group, ranks, dev)
    built = _prepare(schedule, num_ranks, microbatches, chunks, early_grads).lowered
    placement = built.placement
    stage_split = _stage_split(spec, built, split)
    modules: dict[int, StageModule] = {
        s: build_stage(
            spec, stage_split[placement.model_stage(s)], seed=seed, device=dev, dtype=dtype
        )
        for r in local_ranks
        for s in placement.stages_of(r)
    }
    wiring = wire(
        built,
        spec,
        stage_split,
        modules,
        ranks=local_ranks,
        group=group,
        device=dev,
        loss_fn=loss,
        timeout_s=timeout_s,
        hooks=hooks or PipelineHooks(),
    )
    return Pipeline(
        built,
        spec,
        stage_split,
        modules,
        wiring,
        device=dev,
        timeout_s=timeout_s,
        class_targets=loss_fn is None,
        names=names,
    )


def resolve_schedule(
    schedule: ScheduleSource,
    ranks: int,
    microbatches: int,
    chunks: int | None,
    early: bool = True,
) -> Schedule:
    """The lowered, validated program of ``schedule`` (as ``build_pipeline`` runs it)."""
    return _prepare(schedule, ranks, microbatches, chunks, early).lowered


def _prepare(
    schedule: ScheduleSource,
    ranks: int,
    microbatches: int,
    chunks: int | None,
    early: bool,
) -> PreparedSchedule:
    """``schedule`` prepared for ``ranks`` (once: a ``PreparedSchedule`` is taken as it
    is), after checking that a schedule the caller wrote fits the pipeline."""
    if isinstance(schedule, PreparedSchedule):
        _check_fits(schedule.schedule, ranks, microbatches, chunks)
        return schedule
    if isinstance(schedule, Schedule):
        _check_fits(schedule, ranks, microbatches, chunks)
    prepared = prepare_schedule(schedule, ranks, microbatches, chunks, early=early)
    if isinstance(schedule, str) and is_schedule_file(schedule):
        _check_fits(prepared.schedule, ranks, microbatches, chunks)
    return prepared


def _check_fits(schedule: Schedule, ranks: int, microbatches: int, chunks: int | None) -> None:
    """A schedule that brings its own ranks, micro-batches and placement agrees with the
    pipeline's group, ``microbatches`` and ``chunks``."""
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
    per_rank = {len(schedule.placement.stages_of(r)) for r in range(ranks)}
    if chunks is not None and per_rank != {chunks}:
        # A loaded schedule brings its placement; chunks= would otherwise be ignored.
        held = "/".join(str(n) for n in sorted(per_rank))
        raise PipelineInputError(
            f"chunks={chunks}, but schedule {schedule.name!r} has {held} "
            f"stage{'' if held == '1' else 's'} per rank: drop chunks= (a Schedule brings "
            f"its own placement)"
        )


def _check_options(
    microbatches: int,
    ranks: int | None,
    chunks: int | None,
    seed: int,
    timeout_s: float,
    dtype: torch.dtype,
) -> None:
    check_counts(microbatches=microbatches, ranks=ranks, chunks=chunks, seed=seed)
    if microbatches < 1:
        raise PipelineInputError(f"microbatches={microbatches}: use at least 1")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise PipelineInputError(f"timeout_s={timeout_s!r}: use a positive number of seconds")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise PipelineInputError(
            f"dtype={dtype}: parameters need a floating-point dtype (torch.float32, torch.bfloat16)"
        )


def _pipeline_ranks(
    schedule: ScheduleSource, group: Any, ranks: int | None, device: torch.device
) -> tuple[int, tuple[int, ...]]:
    """The number of pipeline ranks, and the ranks whose programs run in this process:
    every one in the debug mode (``group=None``), else this process's rank in ``group``."""
    if group is None:
        if ranks is None:
            if not isinstance(schedule, (Schedule, PreparedSchedule)):
                raise PipelineInputError(
                    "debug mode (group=None) needs ranks=<number of pipeline ranks>"
                )
            plain = schedule.schedule if isinstance(schedule, PreparedSchedule) else schedule
            ranks = plain.num_ranks
        return ranks, tuple(range(ranks))
    _check_group(group, device)
    num_ranks = dist.get_world_size(group)
    if ranks is not None and ranks != num_ranks:
        raise PipelineInputError(
            f"ranks={ranks} but the group has {num_ranks} ranks: drop ranks (the group's "
            f"size is the number of pipeline ranks) or launch {ranks} processes"
        )
    return num_ranks, (dist.get_rank(group),)


def _check_group(group: Any, device: torch.device) -> None:
    """This process is a member of ``group``, whose backend can move ``device``'s tensors."""
    if not dist.is_initialized():
        raise PipelineInputError(
            "group is given but torch.distributed is not initialised: call init_process_group first"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise PipelineInputError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group "
            f"passed as group=: build the pipeline only on that group's ranks"
        )
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        raise PipelineInputError(
            f"the group uses nccl but device is {device}: pass a cuda device or a gloo group"
        )
    if backend_for(device) == "nccl" and backend != "nccl":
        raise PipelineInputError(
            f"device {device} with a {backend} group: create the group with backend 'nccl'"
        )


def _stage_split(
    spec: PipelineSpec, schedule: Schedule, split: Sequence[Sequence[int]] | None
) -> tuple[tuple[int, ...], ...]:
    """The layers of each model stage: ``split`` checked, or an even split."""
    placement = schedule.placement
    stage_split = (
        even_split(len(spec), placement.num_model_stages) if split is None else as_split(split)
    )
    if len(stage_split) != placement.num_model_stages:
        raise PipelineInputError(
            f"split has {len(stage_split)} stages but schedule {schedule.name!r} has {placement.num_model_stages} "
            f"model stages: give one layer range per model stage"
        )
    covered = [i for layers in stage_split for i in layers]
    if covered != list(range(len(spec))):
        raise PipelineInputError(
            f"split {[list(s) for s in stage_split]} does not cover layers 0..{len(spec) - 1} in order exactly once"
        )
    return stage_split
