"""What data parallelism cost a run: bytes reduced per step, waits, state per rank."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.parallel.mesh import Mesh
from pipetrain.tensors import local_tensor

__all__ = ["DataParallelStats", "gather_stats", "state_bytes"]


@dataclass(frozen=True)
class DataParallelStats:
    """What the dp gradient reduction cost over the run, by pipeline rank."""

    replicas: int
    # Gradient bytes each pipeline rank all-reduces (or reduce-scatters) per optimizer
    # step: its stages' unsharded gradients. Sharded, it all-gathers as many bytes of
    # parameters too (once per step: they stay gathered to the stage's last B/W).
    bytes_per_step: tuple[int, ...]
    # Seconds per step each pipeline rank waited for its reductions, mean over the steps
    # and the replicas. DDP: the wait after its pipeline step ended (what the schedule did
    # not hide). Sharded: the time in the reduce-scatters, which block the rank (gloo).
    wait_s: tuple[float, ...]
    # Sharded parameters and optimizer state (FSDP2, --shard) instead of replicated ones.
    sharded: bool = False
    # Bytes of parameters and optimizer state that each global rank stores.
    state_bytes: tuple[int, ...] = ()

    def format(self) -> str:
        sizes = ", ".join(f"{b / 1e6:.2f}" for b in self.bytes_per_step)
        waits = ", ".join(f"{w * 1e3:.1f}" for w in self.wait_s)
        if self.sharded:
            text = (
                f"data parallel: {self.replicas} replicas, sharded (FSDP2); per step, by pipeline "
                f"rank: {sizes} MB of parameters all-gathered and as many of gradients "
                f"reduce-scattered, {waits} ms in the reduce-scatters"
            )
        else:
            text = (
                f"data parallel: {self.replicas} replicas; per step, by pipeline rank: {sizes} MB "
                f"of gradients all-reduced, {waits} ms waited for them after the pipeline"
            )
        if self.state_bytes:
            text += f"; parameters + optimizer state per rank: {max(self.state_bytes) / 1e6:.2f} MB"
        return text

    def to_json(self) -> dict[str, Any]:
        out = {
            "dp_replicas": self.replicas,
            "dp_bytes_per_step": list(self.bytes_per_step),
            "dp_wait_s": list(self.wait_s),
            "dp_sharded": self.sharded,
            "dp_state_bytes": list(self.state_bytes),
        }
        if self.sharded:
            out["dp_all_gather_bytes_per_step"] = list(self.bytes_per_step)
        return out


def state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank stores of ``params`` and of their optimizer state (a DTensor's
    local shard only: what sharding saves)."""

    def nbytes(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    total = 0
    for p in params:
        total += nbytes(p)
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                total += nbytes(value)
    return total


def gather_stats(
    mesh: Mesh, bytes_per_step: int, waits: Sequence[float], *, state_bytes: int, sharded: bool
) -> DataParallelStats:
    """Every rank's reduction cost, grouped by pipeline rank (collective: every rank)."""
    wait = sum(waits) / len(waits) if waits else math.nan
    mine = (mesh.pp_rank, bytes_per_step, wait, state_bytes)
    everyone: list[Any] = [None] * dist.get_world_size(mesh.world_group)
    dist.all_gather_object(everyone, mine, group=mesh.world_group)
    sizes = {pp_rank: nbytes for pp_rank, nbytes, _, _ in everyone}
    by_rank = [[w for r, _, w, _ in everyone if r == pp_rank] for pp_rank in sorted(sizes)]
    return DataParallelStats(
        mesh.dp,
        tuple(sizes[r] for r in sorted(sizes)),
        tuple(sum(w) / len(w) for w in by_rank),
        sharded,
        tuple(int(s) for _, _, _, s in everyone),
    )
