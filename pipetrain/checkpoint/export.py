"""Consolidate a checkpoint's weights into one safetensors file, in one process.

``native`` keeps the global names (``layers.3.attn.wq.weight``; a tied weight once, under
its canonical name), which ``load_weights`` puts back into any split of the model.
``hf`` writes a Hugging Face model directory (config.json, model.safetensors, the run's
tokenizer.json) that transformers loads: ``pipetrain.models.hf`` holds the name maps.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pipetrain.checkpoint import state
from pipetrain.checkpoint.errors import CheckpointCorruptError, CheckpointError
from pipetrain.checkpoint.load import dcp_read, tensor_metadata
from pipetrain.checkpoint.manifest import Manifest, verify_checkpoint
from pipetrain.checkpoint.safetensors_io import write_safetensors
from pipetrain.errors import InputError

__all__ = [
    "EXPORT_FORMATS",
    "ExportResult",
    "export_checkpoint",
    "load_weights",
    "read_weights",
]

EXPORT_FORMATS = ("native", "hf")


@dataclass(frozen=True)
class ExportResult:
    path: Path
    format: str
    tensors: int
    bytes: int


def read_weights(path: Path | str) -> tuple[dict[str, torch.Tensor], Manifest]:
    """Every model tensor of a verified checkpoint under its global name, on the CPU."""
    path = Path(path)
    verification = verify_checkpoint(path)
    if not verification.ok or verification.manifest is None:
        raise CheckpointCorruptError(verification.problems[0])
    wanted = {
        key: torch.empty(size, dtype=dtype)
        for key, (size, dtype) in tensor_metadata(path).items()
        if key.startswith(state.MODEL)
    }
    dcp_read(path, wanted)
    weights = {key[len(state.MODEL) :]: tensor for key, tensor in wanted.items()}
    return weights, verification.manifest


def _export_hf(weights: dict[str, torch.Tensor], manifest: Manifest, out: Path) -> int:
    """A Hugging Face model directory at ``out`` (``pipetrain.models.hf.save_hf``), with the
    run's tokenizer.json when it used one; returns the bytes of model.safetensors."""
    from pipetrain.models.config import ModelConfig
    from pipetrain.models.hf import save_hf

    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"cannot write the export to {out}: it is a file and --format hf writes a "
            "directory; pass --out a directory path"
        )
    try:
        config = ModelConfig(**dict(manifest.model))
    except (TypeError, InputError) as exc:
        raise CheckpointError(f"the checkpoint's model fields are not a model ({exc})") from None
    tokenizer = str(dict(manifest.config).get("data", {}).get("tokenizer", "") or "")
    if tokenizer and not Path(tokenizer).exists():
        raise CheckpointError(
            f"the run's tokenizer {tokenizer} is gone: put it back, or export --format native"
        )
    try:
        save_hf(out, weights, config, tokenizer=tokenizer or None)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the export to {out} ({exc}); pass --out a directory path that is writable"
        ) from None
    return (out / "model.safetensors").stat().st_size


def export_checkpoint(path: Path | str, out: Path | str, *, format: str = "native") -> ExportResult:
    """Write the checkpoint's weights to ``out``: ``native``, one safetensors file with the
    manifest's model config in its metadata; ``hf``, a Hugging Face model directory."""
    if format not in EXPORT_FORMATS:
        raise CheckpointError(f"export format {format!r} is unknown: use one of {EXPORT_FORMATS}")
    weights, manifest = read_weights(path)
    metadata = {
        "format": f"pipetrain-{format}",
        "step": str(manifest.step),
        "model": json.dumps(dict(manifest.model), sort_keys=True),
    }
    out = Path(out)
    if format == "hf":
        return ExportResult(out, format, len(weights), _export_hf(weights, manifest, out))
    if not out.name or out.is_dir():
        raise CheckpointError(
            f"cannot write the export to {out}: it is a directory; pass --out a file path "
            f"such as {out / 'model.safetensors'}"
        )
    # Written beside the target and renamed over it: an export that fails half-way (a
    # full disk, a kill) leaves any earlier file at ``out`` whole.
    partial = out.with_name(f".{out.name}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        size = write_safetensors(partial, weights, metadata)
        partial.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write the export to {out} ({exc}); pass --out a file path in a writable directory"
        ) from None
    return ExportResult(out, format, len(weights), size)


def load_weights(modules: nn.Module | Iterable[nn.Module], file: Path | str) -> tuple[str, ...]:
    """Copy a native export into stage modules (any split; tied copies all filled), reading
    only their tensors from the memory-mapped file. Returns the file's tensor names that no
    module here holds; a module parameter that the file lacks, or whose shape differs,
    raises CheckpointError naming it."""
    from safetensors import safe_open

    index = state.index_parameters([modules] if isinstance(modules, nn.Module) else modules)
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # the header only
            names = set(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in index.tensors if k in names}
        for key, copies in index.tensors.items():
            if key not in names:
                raise CheckpointError(
                    f"{file} has no tensor {key!r}: export a checkpoint of this model"
                )
            if shapes[key] != tuple(copies[0].shape):
                raise CheckpointError(
                    f"{file}: {key} has shape {shapes[key]}, the model "
                    f"{tuple(copies[0].shape)}: export a checkpoint of this model"
                )
        # The file opened for each tensor: pages a read touched stay resident until the
        # file closes (as in pipetrain.models.hf.convert).
        with torch.no_grad():
            for key, copies in index.tensors.items():
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    value = f.get_tensor(key)
                    for tensor in copies:
                        tensor.copy_(value)
                    del value
    except (OSError, CheckpointError):
        raise
    except Exception as exc:  # the package's own error type for a damaged file
        raise CheckpointError(f"{file}: not a safetensors file ({exc})") from None
    return tuple(sorted(names - set(index.tensors)))
