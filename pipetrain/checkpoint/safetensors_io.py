"""A small reader and writer for the safetensors format (no extra dependency).

The format: an 8-byte little-endian header length N, N bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that
follows; an optional ``"__metadata__"`` of strings), then the raw little-endian bytes of
every tensor, back to back. The header is padded with spaces to a multiple of 8 so the
data is aligned. Files written here load with the ``safetensors`` package and vice versa.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

from pipetrain.checkpoint.errors import CheckpointError

__all__ = ["read_safetensors", "write_safetensors"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def write_safetensors(
    path: Path | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` (sorted by name) and return the file size in bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors lacks"
            )
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(_raw_bytes(tensors[name]))
    return 8 + len(text) + offset


def read_safetensors(path: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (copies, on the CPU) and the metadata of a safetensors file."""
    data = Path(path).read_bytes()
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    metadata = header.pop("__metadata__", {}) or {}
    body = memoryview(data)[8 + length :]
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _BY_NAME[info["dtype"]]
        raw = bytearray(body[begin:end])
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        tensors[name] = flat.view(dtype).reshape(info["shape"])
    return tensors, dict(metadata)
