"""Everything that replicates or shards a stage beyond the pipeline.

- ``mesh``: the device mesh of ``pp x dp`` processes, this rank's place in it, the rows of
  a batch each replica reads and the means over replicas.
- ``sync``: one face (``GradientSync``) over the gradients of a stage's replicas, built by
  ``gradient_sync``: ``replicated`` (DDP per stage, bucketed asynchronous all-reduce) or
  ``sharded`` (FSDP2 per stage, reduce-scatter); ``Gradients`` and ``norm_share`` say
  which gradients enter the global norm.
- ``stats``: what the reduction cost (``DataParallelStats``).
- ``ep``: expert parallelism (``expert_groups``, ``shard_experts``: each MoE layer's
  experts over an ep group inside dp, tokens exchanged by all-to-all).
- ``expert_stats``: what the experts did in a step, known on every rank (the auxiliary
  loss, the tokens each expert got, dropped assignments) and the loss-free balancing update.
- ``tp``: tensor parallelism inside a stage (``shard_pipeline``: torch's DTensor plans
  per layer, over the mesh's "tp" dimension).

It takes a built pipeline and a mesh; it knows no trainer.
"""

from pipetrain.parallel.ep import (
    ExpertGradients,
    ExpertGroups,
    expert_groups,
    expert_parameters,
    shard_experts,
)
from pipetrain.parallel.mesh import (
    Mesh,
    build_mesh,
    replica_denominator,
    replica_mean,
    shard_batch,
)
from pipetrain.parallel.replicated import ReplicaGradients
from pipetrain.parallel.sharded import ShardedGradients, check_shardable
from pipetrain.parallel.stats import DataParallelStats, gather_stats, state_bytes
from pipetrain.parallel.sync import Gradients, GradientSync, gradient_sync, norm_share
from pipetrain.parallel.tp import TensorParallelError, check_divisible, shard_pipeline

__all__ = [
    "DataParallelStats",
    "ExpertGradients",
    "ExpertGroups",
    "GradientSync",
    "Gradients",
    "Mesh",
    "ReplicaGradients",
    "ShardedGradients",
    "TensorParallelError",
    "build_mesh",
    "check_divisible",
    "check_shardable",
    "expert_groups",
    "expert_parameters",
    "gather_stats",
    "gradient_sync",
    "norm_share",
    "replica_denominator",
    "replica_mean",
    "shard_batch",
    "shard_experts",
    "shard_pipeline",
    "state_bytes",
]
