"""safetensors files through the ``safetensors`` package, with pipetrain's one-line errors.

``write_safetensors`` writes a whole dict (CPU copies, sorted by name, with string
metadata); ``read_safetensors`` gives a file's tensors and metadata. Readers that need a
few tensors of a large file open it with ``safetensors.safe_open`` instead (memory-mapped:
only the pages of the tensors read are touched), as ``checkpoint.export.load_weights`` and
``models.hf`` do.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from pipetrain.checkpoint.errors import CheckpointError

__all__ = ["read_safetensors", "write_safetensors"]


def _cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, one storage each: the package refuses tensors that share
    memory (a tied pair, views of one buffer), which would be written twice anyway."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if tensor.numel() and pointer in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


def write_safetensors(
    path: Path | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` and return the file size in bytes."""
    from safetensors.torch import save_file

    copies = _cpu_copies(tensors)
    try:
        save_file(copies, str(path), metadata=dict(metadata) if metadata else None)
    except KeyError as exc:  # the package's dtype table lacks this one
        name = next(n for n, t in copies.items() if t.dtype == exc.args[0])
        raise CheckpointError(
            f"tensor {name!r} has dtype {copies[name].dtype}, which safetensors lacks"
        ) from None
    return Path(path).stat().st_size


def read_safetensors(path: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (on the CPU) and the metadata of a safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            names: list[str] = f.keys()  # a safe_open handle is not iterable
            return {key: f.get_tensor(key) for key in names}, dict(metadata)
    except OSError:  # missing or unreadable: the caller's to say, as for any file
        raise
    except Exception as exc:  # the package raises its own error type for a damaged file
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
