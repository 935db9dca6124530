"""Moving stage inputs and gradients between ranks.

Two transports with one interface: ``DistTransport`` (torch.distributed point-to-point on
the pipeline's process group) and ``InMemoryTransport`` (the single-process debug mode,
where every rank runs in one process). Stages on the same rank never use a transport: the
executor hands their tensors over in memory.

A message is named by ``MessageKey(dst_stage, is_grad, microbatch)`` and matched by that
name, never by arrival order (see ``pipetrain.schedules.lowering``). On the wire each
message is a fixed-size int64 header followed by its tensors:

    [MAGIC, step, src_stage, dst_stage, microbatch, is_grad, n,
     n x (dtype code, ndim, d0 .. d5)]

The receiver allocates from the header, so a message of another shape cannot leave stale
rows in a buffer (gloo accepts a shorter message silently) or abort the process (a longer
one), and a message that is not the expected one is an error naming both stages.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.errors import PipelineError, StageMismatchError

__all__ = [
    "DistTransport",
    "InMemoryTransport",
    "MessageKey",
    "backend_for",
    "describe_failure",
]

MAGIC = 0x5049_5045  # "PIPE": a header that is not ours is caught at once
MAX_TENSORS = 8
MAX_DIMS = 6
_FIXED = 7
HEADER_LEN = _FIXED + MAX_TENSORS * (2 + MAX_DIMS)
# Tags per message: one for the header, one per tensor.
_TAGS_PER_MESSAGE = 1 + MAX_TENSORS

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

    def tag(self, num_stages: int) -> int:
        slot = (self.microbatch * num_stages + self.dst_stage) * 2 + int(self.is_grad)
        return slot * _TAGS_PER_MESSAGE


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend that moves tensors of ``device``: nccl for CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


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


def _header(step: int, src: int, key: MessageKey, tensors: tuple[torch.Tensor, ...]) -> list[int]:
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


def _parse_header(
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


_Specs = list[tuple[torch.dtype, tuple[int, ...]]]
# A boundary between two stages in one direction: (source stage, destination, is_grad).
_Boundary = tuple[int, int, bool]


def _specs_of(tensors: tuple[torch.Tensor, ...]) -> _Specs:
    return [(t.dtype, tuple(t.shape)) for t in tensors]


class _Pending:
    """A receive in flight: its header, and its payload once its shapes are known."""

    __slots__ = ("header", "header_work", "payload", "payload_works", "predicted", "src")

    def __init__(self, src: int, header: torch.Tensor, header_work: Any) -> None:
        self.src = src
        self.header = header
        self.header_work = header_work
        self.payload: tuple[torch.Tensor, ...] | None = None
        self.payload_works: list[Any] = []
        self.predicted: _Specs | None = None


class DistTransport:
    """Point-to-point messages over a torch.distributed process group (gloo or nccl).

    ``stage_ranks[s]`` is the group rank of stage ``s``.

    Posting receives early (gloo). The headers of all of a step's receives are posted when
    the step begins. A payload needs its shapes: the first message of a step on each
    boundary is received header first; the later ones carry the same shapes (equal
    micro-batches), so ``progress``, called as each compute action starts, posts the
    payload receives of the next ``lookahead`` messages at once and the transfer overlaps
    the compute. The sender enforces the premise: a message whose shapes differ from the
    first one of its boundary in the step is an error (gloo would abort the process on a
    message longer than the posted buffer). gloo's ``is_completed`` stays False until
    ``wait``, so nothing here polls it.

    NCCL matches messages between two ranks by order, not tag, so there every receive is
    posted when its action runs, in schedule order, header first.

    A send's buffers are kept until it is known to be complete: the activations of
    micro-batch k once the gradient of k has come back from that stage (it was received
    before that gradient was computed), everything else at the end of the step.
    """

    def __init__(
        self,
        group: Any,
        stage_ranks: tuple[int, ...],
        device: torch.device,
        timeout_s: float,
        lookahead: int = 2,
    ) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._stage_ranks = stage_ranks
        self._num_stages = len(stage_ranks)
        self._device = device
        self._timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._early = dist.get_backend(group) == "gloo"
        self._lookahead = lookahead if self._early else 0
        self._step = 0
        self._pending: dict[MessageKey, _Pending] = {}
        self._sends: dict[MessageKey, tuple[list[Any], tuple[torch.Tensor, ...]]] = {}
        self._sent_specs: dict[_Boundary, _Specs] = {}
        self._recv_specs: dict[_Boundary, _Specs] = {}

    # ----------------------------------------------------------------- step bounds
    def begin_step(self, step: int, expected: Iterable[tuple[MessageKey, int]]) -> None:
        """Start a step; ``expected`` lists this rank's receives as (key, source stage)."""
        self._step = step
        # Shapes may change from one step to the next (sequence length): learn them anew.
        self._sent_specs.clear()
        self._recv_specs.clear()
        if self._early:
            for key, src in expected:
                self._post_header(key, src)

    def end_step(self) -> None:
        """Wait until every send of the step has left (its buffers may then be freed)."""
        for key in list(self._sends):
            self._release(key)
        if self._pending:
            keys = ", ".join(str(k) for k in self._pending)
            raise PipelineError(
                f"rank {self._rank}: step {self._step} ended with receives never used: {keys}"
            )

    # ----------------------------------------------------------------- sending
    def send(self, key: MessageKey, src_stage: int, tensors: tuple[torch.Tensor, ...]) -> None:
        specs = _specs_of(tensors)
        boundary = (src_stage, key.dst_stage, key.is_grad)
        first = self._sent_specs.setdefault(boundary, specs)
        if specs != first:
            raise StageMismatchError(
                f"stage {src_stage} sends {specs} to stage {key.dst_stage} for micro-batch {key.microbatch} "
                f"but {first} for an earlier micro-batch of step {self._step}: every micro-batch of a step "
                f"must give the same shapes at a stage boundary"
            )
        peer = self._stage_ranks[key.dst_stage]
        header = torch.tensor(
            _header(self._step, src_stage, key, tensors), dtype=torch.int64, device=self._device
        )
        tag = key.tag(self._num_stages)
        payload = tuple(t.detach().contiguous() for t in tensors)
        works = [dist.isend(header, group=self._group, group_dst=peer, tag=tag)]
        works += [
            dist.isend(t, group=self._group, group_dst=peer, tag=tag + 1 + i)
            for i, t in enumerate(payload)
        ]
        self._sends[key] = (works, (header, *payload))

    def _release(self, key: MessageKey) -> None:
        entry = self._sends.pop(key, None)
        if entry is not None:
            for work in entry[0]:
                self._wait(work, key, sending=True)

    # ----------------------------------------------------------------- receiving
    def _post_header(self, key: MessageKey, src: int) -> _Pending:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._device)
        work = dist.irecv(
            header,
            group=self._group,
            group_src=self._stage_ranks[src],
            tag=key.tag(self._num_stages),
        )
        pending = _Pending(src, header, work)
        self._pending[key] = pending
        return pending

    def _post_payload(self, key: MessageKey, pending: _Pending, specs: _Specs) -> None:
        peer = self._stage_ranks[pending.src]
        tag = key.tag(self._num_stages)
        payload = tuple(
            torch.empty(shape, dtype=dtype, device=self._device) for dtype, shape in specs
        )
        pending.payload = payload
        pending.payload_works = [
            dist.irecv(t, group=self._group, group_src=peer, tag=tag + 1 + i)
            for i, t in enumerate(payload)
        ]

    def progress(self) -> None:
        """Post the payload receives of the next messages whose shapes are known."""
        budget = self._lookahead
        for key, pending in self._pending.items():
            if budget <= 0:
                return
            budget -= 1
            if pending.payload is None:
                specs = self._recv_specs.get((pending.src, key.dst_stage, key.is_grad))
                if specs is None:
                    return  # a boundary's first message: its header must come first
                pending.predicted = specs
                self._post_payload(key, pending, specs)

    def recv(self, key: MessageKey, src_stage: int) -> tuple[torch.Tensor, ...]:
        pending = self._pending.get(key) or self._post_header(key, src_stage)
        self._wait(pending.header_work, key)
        specs = _parse_header(pending.header.tolist(), self._step, pending.src, key)
        if pending.payload is None:
            self._post_payload(key, pending, specs)
            self._recv_specs.setdefault((pending.src, key.dst_stage, key.is_grad), specs)
        elif specs != pending.predicted:
            raise StageMismatchError(
                f"stage {pending.src} announced {specs} for micro-batch {key.microbatch} but stage "
                f"{key.dst_stage} expected {pending.predicted} like the earlier micro-batches of step {self._step}"
            )
        for work in pending.payload_works:
            self._wait(work, key)
        del self._pending[key]
        if key.is_grad:
            # The gradient of micro-batch k was computed from our activations of k: that
            # send is complete, free its buffers now rather than at the end of the step.
            self._release(MessageKey(src_stage, False, key.microbatch))
        assert pending.payload is not None
        return pending.payload

    # ----------------------------------------------------------------- failures
    def _wait(self, work: Any, key: MessageKey, sending: bool = False) -> None:
        try:
            work.wait(self._timeout)
        except RuntimeError as exc:
            raise self.failure(exc, key, sending) from exc

    def failure(self, exc: BaseException, key: MessageKey, sending: bool) -> PipelineError:
        src = self._pending[key].src if key in self._pending else None
        peer_stage = key.dst_stage if sending else src
        peer = "?" if peer_stage is None else str(self._stage_ranks[peer_stage])
        what = "gradient" if key.is_grad else "activations"
        verb = (
            f"sending {what} to stage {key.dst_stage}"
            if sending
            else f"receiving {what} for stage {key.dst_stage}"
        )
        return PipelineError(
            f"rank {self._rank}: step {self._step}, {verb} (micro-batch {key.microbatch}): "
            f"peer rank {peer} {describe_failure(exc, self._timeout_s)}"
        )


class InMemoryTransport:
    """Messages between ranks that all run in this process (the debug mode).

    ``recv`` returns None when the message has not been sent yet: the caller then runs
    another rank. Tensors are handed over as they are, exactly as a copy over the wire
    would arrive, so the arithmetic is the same as with processes.
    """

    def __init__(self) -> None:
        self._box: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self._step = 0

    def begin_step(self, step: int, expected: Iterable[tuple[MessageKey, int]]) -> None:
        del expected  # nothing to post in advance in memory
        self._step = step

    def end_step(self) -> None:
        if self._box:
            keys = ", ".join(str(k) for k in self._box)
            raise PipelineError(f"step {self._step} ended with messages never received: {keys}")

    def send(self, key: MessageKey, src_stage: int, tensors: tuple[torch.Tensor, ...]) -> None:
        del src_stage
        self._box[key] = tuple(t.detach() for t in tensors)

    def progress(self) -> None:
        return None

    def recv(self, key: MessageKey, src_stage: int) -> tuple[torch.Tensor, ...] | None:
        del src_stage
        return self._box.pop(key, None)
