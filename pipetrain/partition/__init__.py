"""Where to cut a model into pipeline stages, and what each stage costs.

Torch-free at import: ``balance`` (splits), ``estimate`` (costs from the model's shape) and
``planner`` (plans for a schedule). ``pipetrain.partition.profile`` measures costs with
torch and is imported on its own.
"""

from pipetrain.partition.balance import (
    LayerCost,
    MemoryModel,
    Partition,
    PartitionError,
    parse_split,
    split_by_cost,
    split_by_params,
    split_explicit,
    split_uniform,
)
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.planner import (
    MicrobatchOption,
    Overheads,
    Plan,
    StagePlan,
    make_plan,
)
from pipetrain.partition.stages import split_layers

__all__ = [
    "LayerCost",
    "MemoryModel",
    "MicrobatchOption",
    "Overheads",
    "Partition",
    "PartitionError",
    "Plan",
    "StagePlan",
    "estimate_costs",
    "make_plan",
    "parse_split",
    "split_by_cost",
    "split_by_params",
    "split_explicit",
    "split_layers",
    "split_uniform",
]
