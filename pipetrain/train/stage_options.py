"""Per-stage options applied to built stages: bf16 autocast, recomputation, torch.compile.

They wrap each layer's ``forward`` on the instance, so parameters keep their global names
and the runtime runs the stage unchanged. Recomputation is per layer: a block keeps only
its input for backward and runs its forward again when the gradient arrives. torch.compile
compiles at a stage's first call: ``first_step_guard`` makes its failure there one line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.config.schema import ConfigError
from pipetrain.errors import InputError
from pipetrain.models import StageModule
from pipetrain.runtime import Pipeline

__all__ = ["StageOptionError", "apply_stage_options", "autocast_dtype", "first_step_guard"]


class StageOptionError(ConfigError):
    """An option the stage or this torch build cannot honour."""


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision setting (None: plain fp32)."""
    return torch.bfloat16 if precision == "bf16" else None


def _wrap(layer: nn.Module, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    inner = layer.forward
    # An instance attribute shadows the class's forward; nn.Module.__call__ finds it.
    layer.forward = functools.wraps(inner)(wrapper(inner))


def _autocast(
    device_type: str, dtype: torch.dtype
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrapper(inner: Callable[..., Any]) -> Callable[..., Any]:
        # Keyword arguments too: a layer's side inputs (constants, extras) come by name.
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device_type, dtype=dtype):
                return inner(*args, **kwargs)

        return forward

    return wrapper


def _recompute(inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        # Non-reentrant checkpointing restores the autocast and RNG state of the forward
        # (and passes keyword arguments on).
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return forward


def apply_stage_options(
    module: StageModule,
    *,
    device: torch.device,
    precision: str,
    recompute: bool,
    compile_stage: bool,
) -> None:
    """Apply the options to every layer of ``module`` in place (``compile`` to the stage)."""
    dtype = autocast_dtype(precision)
    for index, name in zip(module.layer_indices, module.layer_names, strict=True):
        layer = module.get_submodule(name)
        if dtype is not None:
            _wrap(layer, _autocast(device.type, dtype))
        if recompute and module.spec.layers[index].kind == "block":
            _wrap(layer, _recompute)
    if compile_stage:
        if not hasattr(torch, "compile"):
            raise StageOptionError(
                "pipeline.compile needs torch.compile (torch >= 2.0): drop --compile"
            )
        module.compile()


def _run_step(
    pipeline: Pipeline,
    inputs: Any,
    targets: Any,
    denominator: float | None,
    label: str | None,
    ranges: bool,
) -> Any:
    # Only profiled steps pass ``ranges``: a step without them calls what any pipeline has.
    if ranges:
        return pipeline.step(inputs, targets, denominator=denominator, label=label, ranges=True)
    return pipeline.step(inputs, targets, denominator=denominator, label=label)


def first_step_guard(
    pipeline: Pipeline,
    inputs: Any,
    targets: Any,
    *,
    compiled: bool,
    denominator: float | None = None,
    label: str | None = None,
    ranges: bool = False,
) -> Any:
    """Run a step; a failure of torch.compile (it compiles on the first call) becomes one line."""
    if not compiled:
        return _run_step(pipeline, inputs, targets, denominator, label, ranges)
    try:
        return _run_step(pipeline, inputs, targets, denominator, label, ranges)
    except InputError:
        raise
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise StageOptionError(
            f"pipeline.compile: torch.compile failed on this machine ({type(exc).__name__}: {first_line}): "
            f"drop --compile"
        ) from None
