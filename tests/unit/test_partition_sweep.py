"""Bug hunt over splitting: the balancer against what it claims, on the built-in models."""

from __future__ import annotations

import pytest

from pipetrain.models.config import get_model_config
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.planner import make_plan
from pipetrain.schedules.registry import get_spec

MiB = 2**20
COSTS = estimate_costs(get_model_config("llama-default"), 128)


@pytest.mark.parametrize(
    ("schedule", "limit_mib"), [("pipedream", 60), ("pipedream", 80), ("pipedream-2bw", 58)]
)
def test_params_balance_counts_stashed_weight_versions_under_a_limit(
    schedule: str, limit_mib: int
) -> None:
    # The balancer charged one weight version per stage, chose a split that fit that count,
    # and the plan then refused it for the versions PipeDream stashes ("use --balance
    # params"), although a split that fits exists (the one chosen at 70 MiB).
    spec = get_spec(schedule)
    plan = make_plan(
        COSTS,
        schedule_for=lambda m: spec.build(4, m, None),
        batch_size=32,
        microbatches=8,
        method="params",
        memory_limit=limit_mib * MiB,
    )
    assert max(plan.rank_bytes) <= limit_mib * MiB
