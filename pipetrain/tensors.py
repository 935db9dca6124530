"""This rank's part of a tensor, whatever shards it (torch-only, imported by every layer).

FSDP2 (``--shard``) and tensor parallelism (``--tp``) give parameters and gradients as
DTensors; norms, byte counts, sums across ranks and reports work on the local shard.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["local_tensor"]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is.

    No DTensor exists unless its module was imported, and importing it costs about a
    second of every rank's start-up: a run without sharding does not pay it here."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        local: torch.Tensor = tensor.to_local()
        return local
    return tensor
