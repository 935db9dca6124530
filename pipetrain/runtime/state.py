"""A pipeline's weights by global name: this process's part of the model's state dict,
and loading it from a full one (``Pipeline.state_dict`` / ``load_state_dict``).

Each stage keeps its layers' global names, so a full state dict (one process's model, a
Hugging Face import mapped to these names) loads into any split: each process takes its
own layers' tensors and leaves the rest. A sharded (DTensor) tensor is gathered whole by
``full_tensor`` (a collective: call ``state_dict`` on every rank of its mesh), and loaded
by ``distribute_tensor`` from the full tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from pipetrain.models import StageModule
from pipetrain.runtime.errors import PipelineInputError

__all__ = ["load_stage_state", "stage_state"]


def stage_state(modules: Sequence[StageModule]) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``modules`` by global name (a name held by
    several, replicas or every rank's stages in the debug mode, from the first)."""
    state: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, value in module.state_dict().items():
            if name not in state:
                full = getattr(value, "full_tensor", None)
                state[name] = full() if callable(full) else value
    return state


def _names(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(repr(k) for k in keys[:3]) + more


def load_stage_state(
    modules: Sequence[StageModule],
    state: Mapping[str, torch.Tensor],
    model_names: Iterable[str],
    tied_names: Mapping[str, str],
    *,
    strict: bool,
) -> None:
    """Copy from ``state`` every tensor that ``modules`` hold, by global name. A tied copy
    (``tied_names``: its name -> the canonical key) missing from ``state`` takes the
    canonical key's tensor. ``strict``: a name of ``modules`` missing from ``state``, or
    a name of ``state`` outside ``model_names``, is an error and nothing is loaded."""
    known = set(model_names)
    pairs, missing = [], []
    for module in modules:
        for name, target in module.state_dict(keep_vars=True).items():
            key = name if name in state else tied_names.get(name, name)
            if key in state:
                pairs.append((name, target, state[key]))
            else:
                missing.append(name)
    unexpected = [k for k in state if k not in known]
    if strict and (missing or unexpected):
        parts = [f"missing {_names(set(missing))}"] if missing else []
        parts += [f"unexpected {_names(unexpected)}"] if unexpected else []
        raise PipelineInputError(
            f"load_state_dict: {'; '.join(parts)}: pass the state by the model's global names "
            f"(pipe.state_dict()'s), or strict=False to load what matches"
        )
    with torch.no_grad():
        for name, target, value in pairs:
            _assign(name, target, value)


def _assign(name: str, target: torch.Tensor, value: torch.Tensor) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise PipelineInputError(
            f"load_state_dict: {name!r} is {got} but the model's is {tuple(target.shape)}: "
            f"pass a state of this model's sizes"
        )
    mesh = getattr(target, "device_mesh", None)
    if mesh is not None:
        from torch.distributed.tensor import distribute_tensor

        local = value.to(device=target.device, dtype=target.dtype)
        target.copy_(distribute_tensor(local, mesh, target.placements))  # type: ignore[attr-defined]
    else:
        target.copy_(value)
