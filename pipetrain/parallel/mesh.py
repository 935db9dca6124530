"""Pipeline x data (x tensor) parallelism: ``pp * dp * tp`` processes as ``dp * tp``
pipelines of ``pp`` stages, the ``tp`` pipelines of one replica each holding a slice of
every layer (``pipetrain.parallel.tp``).

The processes form a device mesh (torch's DeviceMesh) with dimensions ``("pp", "dp",
"tp")``: global rank ``(pp_rank * dp + dp_rank) * tp + tp_rank``. Each row of the mesh
along "pp" is one pipeline (the runtime runs on that group, never on the world); each
column along "dp" holds the replicas of one pipeline rank's stages; along "tp" (the
innermost, neighbouring ranks) the ranks that share each layer. With tp == 1::

                 dp_rank 0   dp_rank 1
    pp_rank 0     rank 0      rank 1      <- dp group {0, 1}: replicas of stage 0
    pp_rank 1     rank 2      rank 3      <- dp group {2, 3}: replicas of stage 1
                 pipeline 0  pipeline 1

With pp = 2, tp = 2 (dp = 1): pipelines {0, 2} and {1, 3}, tp groups {0, 1} and {2, 3}.

Data: the tp ranks of a replica read the same rows; every replica reads rows ``[dp_rank * B/dp, (dp_rank + 1) * B/dp)`` of the global
batch of B sequences, so the replicas together see each row of every batch exactly once.

Gradients: ``pipetrain.parallel.sync`` (one face, ``GradientSync``, over DDP per stage in
``replicated`` and FSDP2 per stage in ``sharded``).

The mean over replicas is the full batch's gradient even when the replicas hold different
numbers of target tokens (ignored ``-100`` targets): every rank loads the global batch, so
each replica divides its summed loss by the global count over dp (``replica_denominator``)
instead of by its own count, which weights replica r by dp * n_r / N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from pipetrain.config.schema import ConfigError
from pipetrain.runtime.stage import IGNORE_INDEX

__all__ = [
    "Batch",
    "Mesh",
    "build_mesh",
    "replica_denominator",
    "replica_mean",
    "shard_batch",
]


class Batch(Protocol):
    """Rows of token sequences: what ``shard_batch`` splits (the trainer's ``data.Batch``)."""

    @property
    def inputs(self) -> torch.Tensor: ...

    @property
    def targets(self) -> torch.Tensor: ...


RowsT = TypeVar("RowsT", bound=Batch)


@dataclass(frozen=True)
class Mesh:
    """This process's place in the (pp, dp, tp) mesh and the groups of its dimensions."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: Any  # this process's pipeline (a row of the mesh)
    dp_group: Any  # the replicas of this process's stages (a column); None when dp == 1
    world_group: Any  # every process: clipping, the NaN decision, checkpoints
    # The 1-D DeviceMesh of this process's dp group (FSDP2 shards over it); None when dp == 1.
    dp_mesh: Any = None
    # Tensor parallelism: the ranks that share each layer of this process's stages, the
    # innermost dimension (neighbouring ranks, as on one node); tp_mesh None when tp == 1.
    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    tp_mesh: Any = None

    @property
    def rank(self) -> int:
        return (self.pp_rank * self.dp + self.dp_rank) * self.tp + self.tp_rank


def build_mesh(device_type: str, pp: int, dp: int, tp: int = 1) -> Mesh:
    """The (pp, dp, tp) mesh over the initialised default process group: global rank
    ``(pp_rank * dp + dp_rank) * tp + tp_rank``.

    With dp == tp == 1 the pipeline runs on the world group itself, as without this module.
    """
    world = dist.get_world_size()
    if world != pp * dp * tp:
        raise ConfigError(
            f"{world} processes were started but pipeline.pp x pipeline.dp x pipeline.tp is "
            f"{pp} x {dp} x {tp} = {pp * dp * tp}: start {pp * dp * tp} processes or change "
            f"--pp/--dp/--tp"
        )
    rank = dist.get_rank()
    if dp == 1 and tp == 1:
        return Mesh(pp, 1, rank, 0, dist.group.WORLD, None, dist.group.WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return Mesh(
        pp,
        dp,
        rank // (dp * tp),
        rank // tp % dp,
        mesh.get_group("pp"),
        mesh.get_group("dp") if dp > 1 else None,
        dist.group.WORLD,
        mesh["dp"] if dp > 1 else None,
        tp=tp,
        tp_rank=rank % tp,
        tp_group=mesh.get_group("tp") if tp > 1 else None,
        tp_mesh=mesh["tp"] if tp > 1 else None,
    )


def shard_batch(batch: RowsT, dp_rank: int, dp: int) -> RowsT:
    """This replica's contiguous share of the rows of a global batch."""
    rows = batch.inputs.shape[0]
    if rows % dp:
        raise ConfigError(
            f"a batch of {rows} sequences does not split over {dp} data-parallel replicas: "
            f"make data.batch_size a multiple of pipeline.dp x pipeline.microbatches"
        )
    share = rows // dp
    window = slice(dp_rank * share, (dp_rank + 1) * share)
    return dataclasses.replace(batch, inputs=batch.inputs[window], targets=batch.targets[window])  # type: ignore[type-var]


def replica_mean(values: Sequence[float], mesh: Mesh, device: torch.device) -> list[float]:
    """The mean of ``values`` over the dp replicas, known on every rank (float64)."""
    if mesh.dp == 1:
        return list(values)
    box = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.SUM, group=mesh.dp_group)
    return [v / mesh.dp for v in box.tolist()]


def replica_denominator(targets: torch.Tensor, dp: int) -> float:
    """What each replica divides its summed loss by: the global batch's target tokens / dp.

    ``targets`` (B, T) is the global batch, -100 where a token does not count. Replica r
    with n_r of the N tokens then has the loss sum_r / (N / dp) = (dp n_r / N) x its own
    token mean, and the mean over the dp replicas (the all-reduce or reduce-scatter) is
    sum / N, the full batch's, however unevenly the ignored tokens fall.
    """
    tokens = int((targets != IGNORE_INDEX).sum())
    return max(tokens, 1) / dp
