"""Building a pipeline: ``build_pipeline``, its argument checks, and what it is built from
(the device, the split into stages, the schedule); and the checks of a step's arguments
that need what the pipeline was built from (the token table, the denominator).

Kept apart so that the API module (``pipetrain.runtime.api``, which re-exports
``build_pipeline``) holds only the pipeline itself.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models import PipelineSpec, StageModule, build_stage
from pipetrain.models.embedding import Embedding
from pipetrain.runtime.errors import PipelineInputError
from pipetrain.runtime.executor import ComputeHook, GradsHook
from pipetrain.runtime.stage import LossFn, token_cross_entropy
from pipetrain.runtime.transport import backend_for
from pipetrain.schedules import Kind, Schedule
from pipetrain.schedules.early_grads import early_grads as with_early_grads
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.validate import validate

if TYPE_CHECKING:  # api imports this module for the helpers and to re-export build_pipeline
    from pipetrain.runtime.api import Pipeline

__all__ = [
    "CLASS_DTYPES",
    "as_spec",
    "build_pipeline",
    "check_class_targets",
    "check_token_ids",
    "checked_loss",
    "default_device",
    "even_split",
    "forward_only",
    "gpu_identity",
    "positive_count",
    "resolve_schedule",
    "token_table_rows",
    "use_device",
]


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing to do on the CPU).

    Call it before the process group exists. torch's object collectives on nccl
    (``all_gather_object``, ``broadcast_object_list``, ``gather_object``) put their buffers
    on ``torch.cuda.current_device()``, which is cuda:0 until set: every process of a node
    would then meet on GPU 0 and nccl stops them with "Duplicate GPU detected". Pinned
    host buffers and nccl's barrier also go by the current device.

    ``init_process_group(device_id=...)`` would also bind the device, but it makes nccl
    initialise eagerly, and then every point-to-point operation of the group shares the
    group's one communicator and stream (pytorch/pytorch#154132) instead of one per pair
    of ranks, which ``DistTransport``'s per-pair wire orders assume.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)


def gpu_identity(device: torch.device) -> str | None:
    """The UUID of the GPU behind ``device``, the same in every process whatever its
    CUDA_VISIBLE_DEVICES numbers it; None on the CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


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
    schedule: str | Schedule,
    ranks: int,
    microbatches: int,
    chunks: int | None,
    early: bool = True,
) -> Schedule:
    """The lowered, validated program of ``schedule``. A built-in one named by ``schedule``
    gets early input gradients (``pipetrain.schedules.early_grads``) unless ``early`` is
    False; a ``Schedule`` runs as given."""
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
        per_rank = {len(schedule.placement.stages_of(r)) for r in range(ranks)}
        if chunks is not None and per_rank != {chunks}:
            # A loaded schedule brings its placement; chunks= would otherwise be ignored.
            held = "/".join(str(n) for n in sorted(per_rank))
            raise PipelineInputError(
                f"chunks={chunks}, but schedule {schedule.name!r} has {held} "
                f"stage{'' if held == '1' else 's'} per rank: drop chunks= (a Schedule brings "
                f"its own placement)"
            )
        built = schedule
    else:
        from pipetrain.schedules.registry import build_schedule

        built = build_schedule(schedule, ranks, microbatches, chunks=chunks)
        if early:
            built = with_early_grads(built)
    validate(built)
    lowered = lower(built)
    validate(lowered)
    return lowered


def forward_only(schedule: Schedule) -> Schedule:
    """The forward actions of a schedule, in its order (evaluation)."""
    keep = {Kind.F, Kind.SEND_F, Kind.RECV_F}
    rows = tuple(tuple(a for a in row if a.kind in keep) for row in schedule.actions)
    return Schedule(schedule.name + "/forward", schedule.placement, schedule.microbatches, rows)


def _check_counts(**counts: Any) -> None:
    for name, value in counts.items():
        # bool is an int to Python, and a float count fails deep inside a schedule builder.
        if value is None:
            continue
        try:
            operator.index(value)
        except TypeError:
            raise PipelineInputError(f"{name}={value!r}: pass an int") from None
        if isinstance(value, bool):
            raise PipelineInputError(f"{name}={value!r}: pass an int")


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise PipelineInputError(
            f"device={device!r} is not a device torch knows: pass 'cpu', 'cuda:0' or "
            f"default_device()"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PipelineInputError(
            f"device={device!r} but this machine has no CUDA device (or this torch has no CUDA): "
            f"pass default_device(), which falls back to the CPU"
        )
    return dev


def _as_split(split: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    try:
        return tuple(tuple(int(i) for i in layers) for layers in split)
    except (TypeError, ValueError):
        raise PipelineInputError(
            f"split={split!r}: pass one list of layer indices per model stage, e.g. "
            f"[[0, 1, 2], [3, 4, 5]]"
        ) from None


def as_spec(model: PipelineSpec | Sequence[Any]) -> PipelineSpec:
    if isinstance(model, PipelineSpec):
        spec = model
    elif isinstance(model, (list, tuple)):
        spec = PipelineSpec.from_layers(model)
    else:
        raise PipelineInputError(
            f"model is a {type(model).__name__}: pass a PipelineSpec (pipetrain.models.model_spec) or a list of layer factories"
        )
    for i, layer in enumerate(spec.layers):
        # A module is callable too, and "building" it would run its forward without input.
        if isinstance(layer.build, nn.Module):
            kind = type(layer.build).__name__
            raise PipelineInputError(
                f"layer {i} ({layer.name!r}) is a built {kind}, not a factory: pass the class or "
                f"a function that builds it (e.g. lambda: {kind}(...)), so that each stage builds "
                f"only its own layers with seeded weights"
            )
    return spec


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return f"of type {type(value).__name__}"


def checked_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` whose failures and unusable results become one-line PipelineInputErrors.

    Targets of the wrong shape, dtype or range fail inside torch's loss with a message that
    names neither the pipeline's tensors nor the fix; a loss that is not one number, or
    has no gradient, fails later in autograd, far from its cause.
    """

    def run(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(logits, torch.Tensor):
            raise PipelineInputError(
                f"the last layer returned a {type(logits).__name__}: return the logits as a "
                f"tensor (or a tuple whose first element they are)"
            )
        try:
            loss = loss_fn(logits, targets)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError, AttributeError) as exc:
            text = str(exc).strip()
            first = text.splitlines()[0] if text else type(exc).__name__
            raise PipelineInputError(
                f"the loss failed on the last stage's output {_describe(logits)} and targets "
                f"{_describe(targets)} ({first}): pass targets that fit the output (for the "
                f"default cross-entropy: int64 class indices below the vocabulary size, shaped "
                f"like the output without its last dimension, -100 where nothing counts)"
            ) from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipelineInputError(
                f"loss_fn returned a value {_describe(loss)}: return the loss summed over the "
                f"micro-batch as a 0-d tensor (reduction='sum')"
            )
        if torch.is_grad_enabled() and not loss.requires_grad:
            raise PipelineInputError(
                "loss_fn returned a loss without a gradient (detached, computed outside "
                "autograd, or of a model with nothing to train): compute it from the logits "
                "with torch operations"
            )
        return loss

    return run


def build_pipeline(
    model: PipelineSpec | Sequence[Any],
    *,
    schedule: str | Schedule,
    microbatches: int,
    chunks: int | None = None,
    group: Any = None,
    ranks: int | None = None,
    device: torch.device | str | None = None,
    seed: int = 0,
    split: Sequence[Sequence[int]] | None = None,
    loss_fn: LossFn | None = None,
    timeout_s: float = 300.0,
    dtype: torch.dtype = torch.float32,
    step_hook: Callable[[int, int], None] | None = None,
    compute_hook: ComputeHook | None = None,
    grads_hook: GradsHook | None = None,
    early_grads: bool = True,
) -> Pipeline:
    """Build this rank's stages of ``model`` for ``schedule``.

    ``group``: the pipeline's process group (its size is the number of pipeline ranks);
    None runs all ``ranks`` in this process (debug mode). ``split``: layer indices of each
    model stage (default: ``even_split``). ``loss_fn(logits, targets)`` returns the loss
    summed over tokens. ``step_hook(stage, microbatch)`` runs the STEP actions of
    asynchronous schedules; ``compute_hook(action)`` runs before each F, B, I and W (where
    pipetrain.train.pipedream.weights picks a micro-batch's weight version); ``grads_hook(stage)``
    runs right after a stage's last B or W of a training step (data parallelism). Every
    wait gives up after ``timeout_s`` seconds. ``early_grads``: a schedule given by name
    splits the backwards that another rank waits for into I and W, and sends the input
    gradient between them (``pipetrain.schedules.early_grads``: the same order of F, B and
    I, a W in place or moved to the end of its rank, the same gradients to rounding;
    1F1B's cool-down and GPipe's turn shorter); False runs the named schedule's Bs whole.
    """
    # Imported here: api imports this module at its top.
    from pipetrain.runtime.api import Pipeline

    spec = as_spec(model)
    _check_counts(microbatches=microbatches, ranks=ranks, chunks=chunks, seed=seed)
    if microbatches < 1:
        raise PipelineInputError(f"microbatches={microbatches}: use at least 1")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise PipelineInputError(f"timeout_s={timeout_s!r}: use a positive number of seconds")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise PipelineInputError(
            f"dtype={dtype}: parameters need a floating-point dtype (torch.float32, torch.bfloat16)"
        )
    dev = _resolve_device(device)
    if group is None:
        if ranks is None:
            if not isinstance(schedule, Schedule):
                raise PipelineInputError(
                    "debug mode (group=None) needs ranks=<number of pipeline ranks>"
                )
            ranks = schedule.num_ranks
        num_ranks, local_ranks = ranks, tuple(range(ranks))
    else:
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
        if backend == "nccl" and dev.type != "cuda":
            raise PipelineInputError(
                f"the group uses nccl but device is {dev}: pass a cuda device or a gloo group"
            )
        if backend_for(dev) == "nccl" and backend != "nccl":
            raise PipelineInputError(
                f"device {dev} with a {backend} group: create the group with backend 'nccl'"
            )
        num_ranks, local_ranks = dist.get_world_size(group), (dist.get_rank(group),)
        if ranks is not None and ranks != num_ranks:
            raise PipelineInputError(
                f"ranks={ranks} but the group has {num_ranks} ranks: drop ranks (the group's "
                f"size is the number of pipeline ranks) or launch {ranks} processes"
            )
    built = resolve_schedule(schedule, num_ranks, microbatches, chunks, early=early_grads)
    placement = built.placement
    stage_split = (
        even_split(len(spec), placement.num_model_stages) if split is None else _as_split(split)
    )
    if len(stage_split) != placement.num_model_stages:
        raise PipelineInputError(
            f"split has {len(stage_split)} stages but schedule {built.name!r} has {placement.num_model_stages} "
            f"model stages: give one layer range per model stage"
        )
    covered = [i for layers in stage_split for i in layers]
    if covered != list(range(len(spec))):
        raise PipelineInputError(
            f"split {[list(s) for s in stage_split]} does not cover layers 0..{len(spec) - 1} in order exactly once"
        )
    modules = {
        s: build_stage(
            spec, stage_split[placement.model_stage(s)], seed=seed, device=dev, dtype=dtype
        )
        for r in local_ranks
        for s in placement.stages_of(r)
    }
    return Pipeline(
        built,
        spec,
        stage_split,
        local_ranks,
        modules,
        group,
        dev,
        checked_loss(loss_fn or token_cross_entropy),
        timeout_s,
        step_hook,
        compute_hook,
        grads_hook,
        class_targets=loss_fn is None,
    )


def token_table_rows(spec: PipelineSpec, modules: dict[int, StageModule]) -> int | None:
    """The rows of the token table that a first stage here looks ids up in, if any.

    Only an ``embedding`` layer (the built-in models' first) is known to take token ids.
    """
    first = spec.layers[0]
    if first.kind != "embedding":
        return None
    for module in modules.values():
        if module.is_first:
            for sub in module.get_submodule(first.name).modules():
                if isinstance(sub, (nn.Embedding, Embedding)):
                    return int(sub.weight.shape[0])
    return None


def check_token_ids(inputs: torch.Tensor, vocab: int) -> None:
    """Token ids that the embedding cannot look up fail inside torch with "index out of
    range in self" (on CUDA, a device-side assert that ends the process)."""
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        raise PipelineInputError(
            f"inputs are {str(inputs.dtype).removeprefix('torch.')}, but the first layer looks "
            f"up token ids: pass integer ids (torch.long)"
        )
    if inputs.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(inputs))
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise PipelineInputError(
            f"inputs hold token id {bad}, outside the embedding's 0..{vocab - 1}: use a model "
            f"whose vocab_size covers the tokenizer's ids, or map the ids into range"
        )


# The target dtypes that cross-entropy takes as class indices.
CLASS_DTYPES = (torch.int64, torch.uint8)


def check_class_targets(targets: torch.Tensor) -> None:
    """Targets of the default loss are class indices: checked on every rank that has them
    before the step starts, where only the last stage's loss would find out, mid-step, and
    leave the other ranks waiting for it until their timeout."""
    if targets.dtype not in CLASS_DTYPES:
        raise PipelineInputError(
            f"targets are {str(targets.dtype).removeprefix('torch.')}, but the default loss "
            f"(cross-entropy) takes class indices: pass targets as torch.long"
        )


def positive_count(denominator: Any) -> float:
    """``denominator`` as a positive, finite float (a number or a one-element tensor)."""
    try:
        value = math.nan if isinstance(denominator, str) else float(denominator)
    except (TypeError, ValueError, RuntimeError):
        value = math.nan
    if not 0 < value < math.inf:
        raise PipelineInputError(
            f"denominator is {denominator!r}: pass a positive, finite count of tokens"
        )
    return value
