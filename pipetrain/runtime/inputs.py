"""A user's input checked where the pipeline takes it: the model, the split, the device
and the counts given to ``build_pipeline``; the loss; and a step's tensors, checked on
every rank before the step starts (only a last stage would find out, mid-step, and leave
the other ranks waiting for it until their timeout).

Each check raises ``PipelineInputError`` with one line that names the argument and the fix.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.models import PipelineSpec, StageModule
from pipetrain.models.embedding import Embedding
from pipetrain.runtime.device import default_device
from pipetrain.runtime.errors import PipelineInputError
from pipetrain.runtime.stage import IGNORE_INDEX, LossFn
from pipetrain.schedules import Schedule

__all__ = [
    "CLASS_DTYPES",
    "as_spec",
    "as_split",
    "batch_rows",
    "check_class_targets",
    "check_counts",
    "check_token_ids",
    "checked_loss",
    "count_targets",
    "even_split",
    "positive_count",
    "resolve_device",
    "split_batch",
    "token_table_rows",
]


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


def check_counts(**counts: Any) -> None:
    """Each of ``counts`` (name=value) None or an int, not a bool or a float."""
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


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a torch device this machine has; None: ``default_device()``."""
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


def as_split(split: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``split`` (layer indices of each model stage) as tuples of ints."""
    try:
        return tuple(tuple(int(i) for i in layers) for layers in split)
    except (TypeError, ValueError):
        raise PipelineInputError(
            f"split={split!r}: pass one list of layer indices per model stage, e.g. "
            f"[[0, 1, 2], [3, 4, 5]]"
        ) from None


def as_spec(model: PipelineSpec | Sequence[Any]) -> PipelineSpec:
    """``model`` as a ``PipelineSpec`` whose layers are factories, not built modules."""
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


def batch_rows(*batches: object) -> int | None:
    """The batch size of the first of ``batches`` that is a batch (None: none is)."""
    for t in batches:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None


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


def split_batch(
    name: str, batch: torch.Tensor | None, needed: bool, schedule: Schedule, device: torch.device
) -> list[torch.Tensor]:
    """``batch`` (``inputs`` or ``targets``, as ``name`` says) on ``device``, cut into the
    schedule's micro-batches; ``needed``: this process holds the stage that reads it."""
    m = schedule.microbatches
    if batch is None:
        if needed:
            raise PipelineInputError(
                f"this rank holds a {'first' if name == 'inputs' else 'last'} stage: pass {name}"
            )
        return []
    if not isinstance(batch, torch.Tensor):
        raise PipelineInputError(
            f"{name} is a {type(batch).__name__}: pass a tensor (torch.tensor(...)) whose first "
            f"dimension is the batch"
        )
    if batch.dim() < 1 or batch.shape[0] % m:
        params = dict(schedule.params)
        # An asynchronous schedule built for microbatches=m runs a stream of several
        # optimizer steps of m each: the count here is not the one the caller passed.
        stream = (
            f" (schedule {schedule.name!r} streams {params['steps']} steps of "
            f"{params['window']} micro-batches per call: stack the steps' batches)"
            if schedule.asynchronous and {"steps", "window"} <= params.keys()
            else ""
        )
        raise PipelineInputError(
            f"{name} has batch size {batch.shape[0] if batch.dim() else 0}, not a multiple of "
            f"microbatches={m}{stream}: make the batch size a multiple of {m}"
        )
    return list(batch.to(device).chunk(m, dim=0))


def count_targets(
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    has_last: bool,
    denominator: float | None,
) -> int:
    """The targets of a step's batch that count (not -100), after checking that there are
    some to learn from (unless ``denominator`` says what to divide by) and one row of
    targets per row of inputs. ``has_last``: this process holds a last stage."""
    tokens = 0
    if targets is not None:
        tokens = int((targets != IGNORE_INDEX).sum())
        if tokens == 0 and has_last and denominator is None:
            raise PipelineInputError(
                f"targets of shape {tuple(targets.shape)} are empty: pass at least one "
                f"sequence of at least one token"
                if targets.numel() == 0
                else "every target is -100 (ignored): the batch has no token to learn from"
            )
    if (
        isinstance(inputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and inputs.dim() > 0
        and targets.dim() > 0
        and inputs.shape[0] != targets.shape[0]
    ):
        # Checked before any rank starts: only a last stage would find out, mid-step.
        raise PipelineInputError(
            f"inputs hold {inputs.shape[0]} sequences but targets {targets.shape[0]}: pass "
            f"one row of targets per row of inputs"
        )
    return tokens
