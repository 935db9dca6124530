"""Flat, name-keyed views of what a checkpoint holds, as DCP state dicts.

Every key is independent of the layout, so any split of the model can load it:

- ``model/<global name>``: a parameter or persistent buffer. A tied copy (the output
  head holding the embedding weight on another stage) is saved once, under its
  canonical name from ``StageModule.tied_parameters()``.
- ``optim/<global name>/<state>``: the optimizer state of that parameter (``exp_avg``,
  ``step``, ...), and ``optim_group/<global name>``: its param group's hyper-parameters
  (the LR the schedule had set, betas, ...) as JSON. Keyed by name, never by position.
- ``rng/<rank>/<source>``: each rank's random state (python, numpy, torch CPU, CUDA when
  present, and named generators such as the data sampler's).

Non-tensor values are stored as JSON in uint8 tensors so that DCP only ever moves
tensors and nothing is unpickled on load.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.checkpoint.errors import CheckpointIncompatibleError

__all__ = [
    "ParamIndex",
    "apply_optimizer_state",
    "apply_rng_state",
    "copy_tied",
    "decode_json",
    "encode_json",
    "index_parameters",
    "model_entries",
    "optimizer_entries",
    "optimizer_targets",
    "rng_entries",
    "rng_targets",
]

MODEL = "model/"
OPTIM = "optim/"
OPTIM_GROUP = "optim_group/"
RNG = "rng/"


def encode_json(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def decode_json(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.numpy().tobytes()).decode())


@dataclass(frozen=True)
class ParamIndex:
    """Key -> every local tensor saved under it (one, or several tied copies that live in
    different stage modules of this rank), and the reverse map by object identity."""

    tensors: Mapping[str, tuple[torch.Tensor, ...]]
    key_of: Mapping[int, str]  # id(tensor) -> key


def index_parameters(modules: Iterable[nn.Module]) -> ParamIndex:
    tensors: dict[str, list[torch.Tensor]] = {}
    key_of: dict[int, str] = {}
    for module in modules:
        tied = getattr(module, "tied_parameters", None)
        canonical = {id(p): key for key, p in (tied() if callable(tied) else {}).items()}
        for name, tensor in module.state_dict(keep_vars=True).items():
            key = canonical.get(id(tensor), name)
            copies = tensors.setdefault(key, [])
            if all(t is not tensor for t in copies):
                copies.append(tensor)
            key_of[id(tensor)] = key
    return ParamIndex({k: tuple(v) for k, v in tensors.items()}, key_of)


def model_entries(index: ParamIndex) -> dict[str, torch.Tensor]:
    """What this rank saves (and, on load, the tensors DCP fills in place)."""
    return {MODEL + key: copies[0].detach() for key, copies in index.tensors.items()}


def copy_tied(index: ParamIndex) -> None:
    """After loading into the first copy of each key, make the other local copies equal."""
    with torch.no_grad():
        for copies in index.tensors.values():
            for other in copies[1:]:
                other.copy_(copies[0])


def _optimizer_keys(optimizer: torch.optim.Optimizer, index: ParamIndex) -> list[str]:
    """Key of each parameter in the optimizer's own order (the order of its state_dict)."""
    keys = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index.key_of:
                raise CheckpointIncompatibleError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is in none "
                    "of the stage modules; build the optimizer from the pipeline's parameters"
                )
            keys.append(index.key_of[id(p)])
    return keys


def _hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in group.items():
        if name == "params":
            continue
        out[name] = value.item() if isinstance(value, torch.Tensor) else value
    return out


def optimizer_entries(
    optimizer: torch.optim.Optimizer, index: ParamIndex
) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()
    keys = _optimizer_keys(optimizer, index)
    out: dict[str, torch.Tensor] = {}
    position = 0
    for group in state["param_groups"]:
        hyper = encode_json(_hyper_parameters(group))
        for param_id in group["params"]:
            key = keys[position]
            position += 1
            # The first copy of a tied key wins; the copies carry the same state.
            if OPTIM_GROUP + key in out:
                continue
            out[OPTIM_GROUP + key] = hyper
            for name, value in state["state"].get(param_id, {}).items():
                if not isinstance(value, torch.Tensor):
                    value = encode_json(value)
                out[f"{OPTIM}{key}/{name}"] = value
    return out


def optimizer_targets(
    optimizer: torch.optim.Optimizer,
    index: ParamIndex,
    available: Mapping[str, tuple[torch.Size, torch.dtype]],
) -> dict[str, torch.Tensor]:
    """Empty tensors for every saved optimizer entry of this rank's parameters."""
    wanted = set(_optimizer_keys(optimizer, index))
    out: dict[str, torch.Tensor] = {}
    for name, (size, dtype) in available.items():
        if name.startswith(OPTIM_GROUP):
            key = name[len(OPTIM_GROUP) :]
        elif name.startswith(OPTIM):
            key = name[len(OPTIM) :].rsplit("/", 1)[0]
        else:
            continue
        if key in wanted:
            out[name] = _target_like(index.tensors[key][0], size, dtype)
    for key in sorted(wanted):
        if OPTIM_GROUP + key not in out:
            raise CheckpointIncompatibleError(
                f"the checkpoint has no optimizer state for parameter {key!r}; "
                "load the model only (no optimizer) or use a checkpoint of this model"
            )
    return out


def _target_like(param: torch.Tensor, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor for a saved optimizer entry of ``param``.

    A sharded parameter (FSDP2's DTensor) gets its state sharded the same way, so that DCP
    reads only this rank's slice and the optimizer steps shard against shard; everything
    else (plain parameters, the scalar ``step``) gets a whole tensor.
    """
    if isinstance(param, DTensor) and tuple(param.shape) == tuple(size):
        return torch.empty_like(param, dtype=dtype).detach()
    return torch.empty(size, dtype=dtype)


def _restore_value(value: Any) -> Any:
    # JSON turned tuples (betas) into lists; no optimizer hyper-parameter is a list.
    return tuple(value) if isinstance(value, list) else value


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer, index: ParamIndex, loaded: Mapping[str, torch.Tensor]
) -> None:
    """Rebuild the optimizer's positional state dict from name-keyed entries and load it,
    so torch casts each state tensor to its parameter's device and dtype."""
    keys = _optimizer_keys(optimizer, index)
    per_key: dict[str, dict[str, Any]] = {}
    for name, tensor in loaded.items():
        if name.startswith(OPTIM) and not name.startswith(OPTIM_GROUP):
            key, state_name = name[len(OPTIM) :].rsplit("/", 1)
            is_json = tensor.dtype == torch.uint8 and tensor.dim() == 1
            per_key.setdefault(key, {})[state_name] = decode_json(tensor) if is_json else tensor
    state: dict[int, dict[str, Any]] = {}
    given: set[str] = set()
    groups: list[dict[str, Any]] = []
    position = 0
    for group in optimizer.param_groups:
        positions = list(range(position, position + len(group["params"])))
        position += len(positions)
        first_key = keys[positions[0]] if positions else None
        hyper = decode_json(loaded[OPTIM_GROUP + first_key]) if first_key else {}
        restored = {name: _restore_value(v) for name, v in hyper.items()}
        groups.append({**_hyper_parameters(group), **restored, "params": positions})
        for i in positions:
            if keys[i] not in per_key:
                continue
            entries = per_key[keys[i]]
            if keys[i] in given:
                # A second tied copy needs tensors of its own: torch keeps the ones it is
                # given when device and dtype already match, and would update them twice.
                entries = {
                    n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in entries.items()
                }
            given.add(keys[i])
            state[i] = dict(entries)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def rng_entries(rank: int, generators: Mapping[str, torch.Generator]) -> dict[str, torch.Tensor]:
    prefix = f"{RNG}{rank}/"
    python_state = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # legacy=True always gives the tuple form
    out = {
        prefix + "python": encode_json([python_state[0], list(python_state[1]), python_state[2]]),
        prefix + "numpy": encode_json(
            [numpy_state[0], numpy_state[1].tolist(), *(float(x) for x in numpy_state[2:])]
        ),
        prefix + "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"{prefix}cuda/{i}"] = cuda_state
    for name, generator in generators.items():
        out[f"{prefix}gen/{name}"] = generator.get_state()
    return out


def rng_targets(
    rank: int, available: Mapping[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, torch.Tensor]:
    prefix = f"{RNG}{rank}/"
    return {
        name: torch.empty(size, dtype=dtype)
        for name, (size, dtype) in available.items()
        if name.startswith(prefix)
    }


def apply_rng_state(
    rank: int, loaded: Mapping[str, torch.Tensor], generators: Mapping[str, torch.Generator]
) -> tuple[str, ...]:
    """Restore the random state saved by ``rank``; returns the generator names that the
    checkpoint did not hold (left as they are)."""
    prefix = f"{RNG}{rank}/"
    python_state = decode_json(loaded[prefix + "python"])
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    name, keys, pos, has_gauss, cached = decode_json(loaded[prefix + "numpy"])
    np.random.set_state((name, np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(loaded[prefix + "torch"])
    if torch.cuda.is_available():
        cuda_states = [
            loaded[f"{prefix}cuda/{i}"]
            for i in range(torch.cuda.device_count())
            if f"{prefix}cuda/{i}" in loaded
        ]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    missing = []
    for gen_name, generator in generators.items():
        saved = loaded.get(f"{prefix}gen/{gen_name}")
        if saved is None:
            missing.append(gen_name)
        else:
            generator.set_state(saved)
    return tuple(missing)
