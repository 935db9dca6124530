"""The wire format of one message: its name, the header that announces its tensors, and
the packed form that carries both in one buffer.

Each message is a fixed-size int64 header followed by its tensors, all with one tag:

    [MAGIC, step, src_stage, dst_stage, microbatch, is_grad, n,
     n x (dtype code, ndim, d0 .. d5)]

The receiver allocates from the header, so a message of another shape cannot leave stale
rows in a buffer (gloo accepts a shorter message silently) or abort the process (a longer
one), and a message that is not the expected one (the ranks disagree on the schedule or
the order) is an error naming both stages.

Packed messages. Once the first message of a boundary in a step has announced the shapes,
the receiver knows the size of the later ones (all micro-batches of a step have the same
shapes there, which the sender enforces), so those of up to ``PACK_LIMIT`` bytes travel as
one byte buffer holding the header and every tensor (``pack``/``unpack``): one transfer
instead of 1 + n, with the header still checked on every message. So does a later step's
first message when the shapes it was guessed to have are small enough (``DistTransport``).
Each part starts on a 64-byte boundary, so the tensors are views of the buffer with their
natural alignment.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from pipetrain.runtime.errors import StageMismatchError
from pipetrain.runtime.waits import host_ints, to_device

__all__ = [
    "HEADER_LEN",
    "PACK_LIMIT",
    "TAG",
    "Acks",
    "Boundary",
    "MessageKey",
    "Specs",
    "describe_failure",
    "header_values",
    "is_packable",
    "message_parts",
    "pack",
    "packed_header",
    "packed_size",
    "packed_tensors",
    "parse_header",
    "specs_of",
    "unpack",
]

MAGIC = 0x5049_5045  # "PIPE": a header that is not ours is caught at once
MAX_TENSORS = 8
MAX_DIMS = 6
_FIXED = 7
HEADER_LEN = _FIXED + MAX_TENSORS * (2 + MAX_DIMS)
# Every message, header and payload, uses this one tag: messages match by order
# (pipetrain.runtime.transport.DistTransport).
TAG = 0

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class MessageKey:
    """The name of one message: what ``dst_stage`` receives for ``microbatch``."""

    dst_stage: int
    is_grad: bool
    microbatch: int

    def __str__(self) -> str:
        what = "gradient" if self.is_grad else "activations"
        return f"{what} for stage {self.dst_stage} of micro-batch {self.microbatch}"


# Each message a rank receives -> the gradients it sent whose arrival that message proves
# (``pipetrain.schedules.acks``), which its transport may then free.
Acks = Mapping[MessageKey, tuple[MessageKey, ...]]


def describe_failure(exc: BaseException, timeout_s: float) -> str:
    """What a failed wait means, in words (gloo reports a dead peer as a closed connection)."""
    text = str(exc)
    if "Connection closed by peer" in text or "Connection reset" in text or "pair closure" in text:
        return (
            "was lost (its process died or closed the connection; if it failed on an error of "
            "its own, its log names the first failure)"
        )
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return f"did not answer within {timeout_s:g} s (raise timeout_s if the stage is just slow)"
    return f"failed: {text.splitlines()[0] if text else type(exc).__name__}"


def header_values(
    step: int, src: int, key: MessageKey, tensors: tuple[torch.Tensor, ...]
) -> list[int]:
    if len(tensors) > MAX_TENSORS:
        raise StageMismatchError(
            f"stage {src} sends {len(tensors)} tensors to stage {key.dst_stage}: at most "
            f"{MAX_TENSORS} per boundary; pack them into fewer tensors"
        )
    values = [MAGIC, step, src, key.dst_stage, key.microbatch, int(key.is_grad), len(tensors)]
    for t in tensors:
        if t.dim() > MAX_DIMS or t.dtype not in _DTYPE_CODE:
            raise StageMismatchError(
                f"stage {src} sends a {t.dim()}-d {t.dtype} tensor to stage {key.dst_stage}: "
                f"the transport carries up to {MAX_DIMS} dims of {', '.join(map(str, _DTYPES))}"
            )
        values += [_DTYPE_CODE[t.dtype], t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
    values += [0] * (HEADER_LEN - len(values))
    return values


def parse_header(
    values: list[int], step: int, src: int, key: MessageKey, where: str = ""
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The tensor specs of a received header, checked against the message expected there
    (``step``: the wire's step number; ``where``: the step as errors name it)."""
    got = tuple(values[1:6])
    want = (step, src, key.dst_stage, key.microbatch, int(key.is_grad))
    if values[0] != MAGIC or got != want:
        when = f"{where} (step {step} on the wire)" if where else f"step {step}"
        raise StageMismatchError(
            f"stage {key.dst_stage} expected {'gradient' if key.is_grad else 'activations'} of "
            f"micro-batch {key.microbatch} from stage {src} in {when}, but got a message "
            f"with (step, src, dst, micro-batch, is_grad) = {got}: the ranks run different "
            f"schedules; build every rank's pipeline with the same schedule"
        )
    specs = []
    for i in range(values[6]):
        base = _FIXED + i * (2 + MAX_DIMS)
        ndim = values[base + 1]
        specs.append((_DTYPES[values[base]], tuple(values[base + 2 : base + 2 + ndim])))
    return specs


Specs = list[tuple[torch.dtype, tuple[int, ...]]]
# A boundary between two stages in one direction: (source stage, destination, is_grad).
Boundary = tuple[int, int, bool]


def specs_of(tensors: tuple[torch.Tensor, ...]) -> Specs:
    return [(t.dtype, tuple(t.shape)) for t in tensors]


_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


@functools.lru_cache(maxsize=256)
def _layout(specs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> tuple[tuple[int, ...], int]:
    """Byte offset of each tensor in a packed message, and the message's size (a step
    repeats the same few specs, hence the cache)."""
    offsets = []
    at = _aligned(HEADER_LEN * 8)
    for dtype, shape in specs:
        offsets.append(at)
        at += _aligned(_nbytes(dtype, shape))
    return tuple(offsets), at


def packed_size(specs: Specs) -> int:
    """Bytes of a packed message whose tensors have ``specs``."""
    return _layout(tuple(specs))[1]


# Packing copies the tensors, and a sent copy lives until the send is known complete (for
# activations, until their gradient returns: all of a GPipe step's micro-batches). Small
# messages gain most from one transfer instead of two, and past a few hundred KiB a
# transfer's fixed cost is below the copy's, so only messages up to this size are packed:
# the extra memory stays within micro-batches x 512 KiB.
PACK_LIMIT = 512 * 1024


def is_packable(specs: Specs) -> bool:
    """Whether a later message of a boundary with ``specs`` travels packed (both ends
    decide alike from the shapes the boundary's first message announced)."""
    return packed_size(specs) <= PACK_LIMIT


def pack(header: list[int], tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One uint8 buffer on the tensors' device: the header, then each tensor (aligned)."""
    offsets, size = _layout(tuple(specs_of(tensors)))
    device = tensors[0].device if tensors else torch.device("cpu")
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    buf[: HEADER_LEN * 8].view(torch.int64).copy_(to_device(header, device))
    for at, t in zip(offsets, tensors, strict=True):
        buf[at : at + _nbytes(t.dtype, tuple(t.shape))].view(t.dtype).view(t.shape).copy_(t)
    return buf


def unpack(buf: torch.Tensor, specs: Specs) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """The header values and the tensors (views of ``buf``) of a packed message, once its
    transfer is complete."""
    return packed_header(buf), packed_tensors(buf, specs)


def packed_header(buf: torch.Tensor) -> list[int]:
    """The header values of a packed message, once its transfer is complete."""
    return host_ints(buf[: HEADER_LEN * 8].view(torch.int64))


def packed_tensors(buf: torch.Tensor, specs: Specs) -> tuple[torch.Tensor, ...]:
    """The tensors of a packed message with ``specs``: views of ``buf``."""
    offsets, _ = _layout(tuple(specs))
    return tuple(
        buf[at : at + _nbytes(dtype, shape)].view(dtype).view(shape)
        for at, (dtype, shape) in zip(offsets, specs, strict=True)
    )


def message_parts(
    values: list[int], tensors: tuple[torch.Tensor, ...], missed: Specs | None, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The transfers of one unpacked message, in order: its header, then its tensors.

    ``missed``: the receiver posted these guessed shapes, not the message's, so a filler of
    their sizes goes between the header and the payload (docs/transport.md): one buffer of
    the guessed packed size with the true header in it, or the header and guessed tensors.
    """
    if missed is None:
        return (to_device(values, device), *tensors)
    if is_packable(missed):
        filler = torch.zeros(packed_size(missed), dtype=torch.uint8, device=device)
        filler[: HEADER_LEN * 8].view(torch.int64).copy_(to_device(values, device))
        return (filler, *tensors)
    fill = tuple(torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in missed)
    return (to_device(values, device), *fill, *tensors)
