"""Hugging Face weights into built stage modules, and pipetrain weights out as a Hugging
Face model directory.

Import reads only the tensors of the parameters the given modules hold: each file is
opened memory-mapped with ``safetensors.safe_open`` and a tensor is read when a module
here needs it, so a rank's memory holds its own stage, not the model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.models.config import ModelConfig
from pipetrain.models.hf.config import HFImportError, hf_config_dict, read_hf_config
from pipetrain.models.hf.files import SINGLE_NAME, check_weights, tensor_files
from pipetrain.models.hf.names import Source, weight_sources

__all__ = ["HFLoad", "full_modules", "hf_state_dict", "load_hf_weights", "save_hf", "to_pipetrain"]


@dataclass(frozen=True)
class HFLoad:
    """What ``load_hf_weights`` read: the directory's model and the tensors it copied."""

    architecture: str
    config: ModelConfig
    tensors: int  # parameters filled here (a tied pair held twice counts twice)
    files: tuple[str, ...]  # the safetensors files opened


def _stage_modules(target: Any) -> list[nn.Module]:
    """A module, some modules, or anything with ``.modules`` (a built ``Pipeline``)."""
    if isinstance(target, nn.Module):
        return [target]
    held = getattr(target, "modules", target)
    return list(held() if callable(held) else held)


def _halves_to_pairs(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Each head's rows from Hugging Face's [x0, x2, ...; x1, x3, ...] rotary halves to
    pipetrain's (x0, x1), (x2, x3), ... pairs: the same rotation, other row order."""
    rows, rest = t.shape[0], t.shape[1:]
    return t.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _pairs_to_halves(t: torch.Tensor, heads: int) -> torch.Tensor:
    rows, rest = t.shape[0], t.shape[1:]
    return t.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def to_pipetrain(t: torch.Tensor, source: Source) -> torch.Tensor:
    """A Hugging Face tensor as the pipetrain parameter ``source`` describes."""
    if source.parts > 1:
        t = t.chunk(source.parts, dim=-1)[source.part]
    if source.transpose:
        t = t.t()
    if source.rope_heads:
        t = _halves_to_pairs(t, source.rope_heads)
    return t


def _to_hf(t: torch.Tensor, source: Source) -> torch.Tensor:
    if source.rope_heads:
        t = _pairs_to_halves(t, source.rope_heads)
    return t.t() if source.transpose else t


def load_hf_weights(target: Any, directory: Path | str, *, check: bool = True) -> HFLoad:
    """Copy a Hugging Face model directory's weights into stage modules (a ``Pipeline``,
    a module or a list of them) built from its ``config.json``
    (``read_hf_config(directory).config``), by global name. ``check``: first compare
    every needed tensor's shape with config.json (headers only)."""
    hf = read_hf_config(directory)
    sources = weight_sources(hf.config)
    wanted: dict[str, list[tuple[torch.Tensor, Source]]] = {}
    for module in _stage_modules(target):
        for name, tensor in module.state_dict(keep_vars=True).items():
            if name not in sources:
                raise HFImportError(
                    f"the model has {name!r}, which {directory}'s {hf.architecture} lacks: "
                    "build the pipeline from read_hf_config(directory).config"
                )
            wanted.setdefault(sources[name].key, []).append((tensor, sources[name]))
    if check:
        check_weights(directory, {s.key: s for pairs in wanted.values() for _, s in pairs})
    files = tensor_files(directory)
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    from safetensors import safe_open

    count = 0
    with torch.no_grad():
        for path, keys in sorted(by_file.items()):
            for key in keys:
                # The file opened for each tensor: a tensor read is a view of the memory
                # map, and the pages it touched stay resident until the file is closed,
                # so one open file would hold this rank's whole part of the shard on top
                # of its copy (BENCHMARKS.md, import memory); a header per tensor is cheap.
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    raw = f.get_tensor(key)
                    for tensor, source in wanted[key]:
                        _copy_checked(tensor, to_pipetrain(raw, source), path, key)
                        count += 1
                    del raw
    return HFLoad(hf.architecture, hf.config, count, tuple(sorted(p.name for p in by_file)))


def _copy_checked(tensor: torch.Tensor, value: torch.Tensor, path: Path, key: str) -> None:
    if value.shape != tensor.shape:
        raise HFImportError(
            f"{path.name}: {key} gives a tensor of shape {tuple(value.shape)} but the "
            f"model's is {tuple(tensor.shape)}: build the pipeline from its config.json"
        )
    tensor.copy_(value)


def hf_state_dict(
    weights: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """pipetrain weights by global name (a tied head once, as ``embed.tok.weight``) under
    Hugging Face names: fused and transposed back, rotary halves restored."""
    grouped: dict[str, dict[int, tuple[str, Source]]] = {}
    for name, source in weight_sources(config).items():
        parts = grouped.setdefault(source.key, {})
        if source.part not in parts and name in weights:
            parts[source.part] = (name, source)
    out: dict[str, torch.Tensor] = {}
    for key, parts in grouped.items():
        count = next(iter(parts.values()))[1].parts if parts else 1
        if len(parts) != count:
            missing = next(n for n, s in weight_sources(config).items() if s.key == key)
            raise HFImportError(f"the weights lack {missing!r}: export a whole model")
        pieces = [
            _to_hf(weights[name], source) for name, source in (parts[i] for i in range(count))
        ]
        out[key] = (torch.cat(pieces, dim=-1) if count > 1 else pieces[0]).contiguous().clone()
    return out


def save_hf(
    directory: Path | str,
    weights: Mapping[str, torch.Tensor],
    config: ModelConfig,
    *,
    tokenizer: Path | str | None = None,
) -> Path:
    """Write a Hugging Face model directory (config.json, model.safetensors, and
    tokenizer.json when given) that ``AutoModelForCausalLM.from_pretrained`` loads."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = hf_state_dict(weights, config)
    directory.mkdir(parents=True, exist_ok=True)
    # Each file written beside its target and renamed over it: a failed export leaves an
    # earlier one whole.
    partial = directory / f".{SINGLE_NAME}.partial"
    try:
        save_file(tensors, str(partial), metadata={"format": "pt"})
        partial.replace(directory / SINGLE_NAME)
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    if tokenizer:
        shutil.copyfile(tokenizer, directory / "tokenizer.json")
    return directory


def full_modules(modules: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of ``modules`` by global name (tied copies under each name)."""
    return {
        name: tensor.detach()
        for module in modules
        for name, tensor in module.state_dict(keep_vars=True).items()
    }
