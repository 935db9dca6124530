"""One face for the gradients of a stage's replicas, whichever way they are kept.

The trainer builds a ``GradientSync`` with ``gradient_sync`` and calls it the same way for
replicated stages (``replicated.ReplicaGradients``: DDP per stage, all-reduce) and for
sharded ones (``sharded.ShardedGradients``: FSDP2 per stage, reduce-scatter):

    sync = gradient_sync(mesh, shard=..., timeout_s=...)   # None without replicas
    build_pipeline(..., hooks=PipelineHooks(grads_hook=sync.grads_hook))  # grads final
    sync.attach(pipeline)                                  # before the optimizer is built
    per optimizer step: sync.begin(sync=last_micro_step) before each pipeline step,
                        sync.finish(step) after the last one
    after an evaluation: sync.after_eval()
    at the end: sync.stats(...)

``Gradients`` and ``norm_share`` say which of a rank's gradients enter the global norm
once the replicas hold theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pipetrain.parallel.mesh import Mesh
from pipetrain.parallel.stats import DataParallelStats

if TYPE_CHECKING:
    from pipetrain.parallel.ep import ExpertGradients
    from pipetrain.runtime import Pipeline

__all__ = ["GradientSync", "Gradients", "gradient_sync", "norm_share"]


class GradientSync(Protocol):
    """The gradients of one pipeline rank's stages across their data-parallel replicas."""

    @property
    def sharded(self) -> bool:
        """Each replica holds a slice of the parameters (gathering them takes every replica)."""
        ...

    @property
    def launched_in_step(self) -> tuple[int, ...]:
        """Stages whose reduction ran inside the last pipeline step (overlapped)."""
        ...

    def attach(self, pipeline: Pipeline) -> None: ...

    def begin(self, sync: bool) -> None: ...

    def grads_hook(self, stage: int) -> None: ...

    def finish(self, step: int) -> None: ...

    def after_eval(self) -> None: ...

    def stats(self, skip_first: int = 1, *, state_bytes: int = 0) -> DataParallelStats: ...


def gradient_sync(
    mesh: Mesh | None,
    *,
    shard: bool,
    timeout_s: float,
    experts: ExpertGradients | None = None,
    grad_views: bool = False,
) -> GradientSync | None:
    """Replicated (or, with ``shard``, sharded) stages over ``mesh``'s dp groups; None when
    there is no replica to keep in step. ``experts``: expert parallelism (replicated only),
    the routed experts reduced over their own replicas; ``grad_views``: replicated only,
    the gradients as views of persistent flat buckets."""
    if mesh is None or mesh.dp == 1:
        return None
    # Imported here: FSDP2 only for runs that shard.
    if shard:
        from pipetrain.parallel.sharded import ShardedGradients

        return ShardedGradients(mesh, timeout_s=timeout_s)
    from pipetrain.parallel.replicated import ReplicaGradients

    return ReplicaGradients(mesh, timeout_s=timeout_s, experts=experts, grad_views=grad_views)


@dataclass(frozen=True)
class Gradients:
    """The parameters of one rank, as the norm sees them.

    ``counted`` enter the global norm; ``all`` are scaled and stepped. They differ by the
    second copy of a tied weight: both copies are stepped, one is counted.
    """

    counted: tuple[torch.Tensor, ...]
    all: tuple[torch.Tensor, ...]

    @classmethod
    def of(
        cls, params: Sequence[torch.Tensor], *, not_counted: Sequence[torch.Tensor] = ()
    ) -> Gradients:
        skip = {id(p) for p in not_counted}
        return cls(tuple(p for p in params if id(p) not in skip), tuple(params))


def norm_share(
    grads: Gradients,
    mesh: Mesh,
    *,
    sharded: bool = False,
    experts: tuple[Sequence[torch.Tensor], bool] | None = None,
) -> Gradients:
    """The share of the global norm this rank adds, when the sum runs over the world group.

    After the dp all-reduce every replica holds the same gradients: only replica 0 counts
    its squares, so the world sum is the norm of one model. Sharded, each replica holds a
    different slice of them and counts its own (optim's ``check_gradients`` takes the
    local shards). Under tensor parallelism a layer's sharded weights are different
    slices on each tp rank and all count; what every tp rank holds whole (norms, the
    row-wise projections' biases) counts on tp rank 0 only. Every rank still checks every
    gradient of its own for non-finite values, so all ranks decide a skip together.

    ``experts`` (parameters, counted here): under expert parallelism each ep rank holds
    other experts, each replicated over dp / ep ranks: the first of those replicas counts.
    """
    if experts is not None:
        routed = {id(p) for p in experts[0]}
        dense = Gradients(tuple(p for p in grads.counted if id(p) not in routed), grads.all)
        mine = norm_share(dense, mesh, sharded=sharded).counted
        if experts[1] and mesh.tp_rank == 0:  # experts are whole on every tp rank
            mine += tuple(p for p in grads.counted if id(p) in routed)
        return Gradients(counted=mine, all=grads.all)
    if mesh.dp_rank != 0 and not sharded:
        return Gradients(counted=(), all=grads.all)
    if mesh.tp > 1 and mesh.tp_rank != 0:
        return Gradients(counted=tuple(p for p in grads.counted if _tp_sharded(p)), all=grads.all)
    return grads


def _tp_sharded(param: torch.Tensor) -> bool:
    """Whether the ranks of the "tp" dimension hold different slices of ``param``."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return False
    return isinstance(param.placements[names.index("tp")], Shard)
