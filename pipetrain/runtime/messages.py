"""One message on the wire: its name, and the header that announces its tensors.

Each message is a fixed-size int64 header followed by its tensors, all with one tag:

    [MAGIC, step, src_stage, dst_stage, microbatch, is_grad, n,
     n x (dtype code, ndim, d0 .. d5)]

The receiver allocates from the header, so a message of another shape cannot leave stale
rows in a buffer (gloo accepts a shorter message silently) or abort the process (a longer
one), and a message that is not the expected one (the ranks disagree on the schedule or
the order) is an error naming both stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetrain.runtime.errors import StageMismatchError

__all__ = [
    "HEADER_LEN",
    "TAG",
    "Boundary",
    "MessageKey",
    "Specs",
    "describe_failure",
    "header_values",
    "parse_header",
    "specs_of",
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
    values: list[int], step: int, src: int, key: MessageKey
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    got = tuple(values[1:6])
    want = (step, src, key.dst_stage, key.microbatch, int(key.is_grad))
    if values[0] != MAGIC or got != want:
        raise StageMismatchError(
            f"stage {key.dst_stage} expected {'gradient' if key.is_grad else 'activations'} of "
            f"micro-batch {key.microbatch} from stage {src} in step {step}, but got a message "
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
