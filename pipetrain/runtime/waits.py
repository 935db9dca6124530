"""Waiting for a torch.distributed operation with a deadline, and reading small device
tensors on the host, without stalling a CUDA device's work.

On gloo, ``work.wait(timeout)`` blocks until the transfer is done or the timeout passes,
and that is all it costs. On NCCL, ``work.wait(timeout)`` with a timeout blocks in
ProcessGroupNCCL's loop that sleeps a millisecond between checks, so a message that lands
just after a check is seen up to a millisecond late, at every receive on the critical
path. ``finish`` polls ``is_completed`` itself (yields first, then short naps) up to the
deadline, then calls ``wait()`` without a timeout, which on NCCL only orders the current
CUDA stream after the operation (and raises its error, if any).

``host_ints`` reads a header on the host. ``tensor.tolist()`` of a CUDA tensor copies on
the current stream and waits for everything queued there, so each message read would
drain the compute queued before it; the copy runs on a side stream instead, after the
transfer is known complete.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

__all__ = ["finish", "host_ints", "to_device"]

# Yields before napping: a transfer on the critical path usually lands within
# microseconds of its wait, and a yield gives the CPU back to the other ranks of the node.
_YIELDS = 2000
_NAP_S = 50e-6


def finish(work: Any, timeout_s: float, polls: bool) -> None:
    """Wait for ``work`` to complete, at most ``timeout_s``; a RuntimeError saying "Timed
    out" when it does not (``messages.describe_failure`` words it). ``polls``: the
    backend's ``is_completed`` tells the truth before ``wait`` (NCCL; gloo's does not)."""
    if not polls:
        work.wait(datetime.timedelta(seconds=timeout_s))
        return
    if not work.is_completed():
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise RuntimeError(f"Timed out after {timeout_s:g} s waiting for a transfer")
            spins += 1
            time.sleep(0.0 if spins < _YIELDS else _NAP_S)
    work.wait()


_side_streams: dict[int, Any] = {}


def host_ints(tensor: torch.Tensor) -> list[int]:
    """The values of a small integer tensor whose producer is known to be complete."""
    if tensor.device.type != "cuda":
        values: list[int] = tensor.tolist()  # an int64 tensor gives Python ints
        return values
    index = tensor.device.index if tensor.device.index is not None else 0
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=tensor.device)  # type: ignore[no-untyped-call]
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(tensor, non_blocking=True)
    stream.synchronize()
    values = host.tolist()
    return values


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``. On CUDA the copy leaves from pinned
    memory without waiting: one from pageable memory waits until the current stream has
    finished everything queued on it."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
