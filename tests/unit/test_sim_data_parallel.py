"""The data-parallel all-reduce on simulated pipeline timelines (pure, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.schedules.execution import Costs
from pipetrain.schedules.registry import build_schedule
from pipetrain.sim import simulate
from pipetrain.sim.data_parallel import DataParallelError, data_parallel_cost, ring_allreduce_time


def test_ring_allreduce_time() -> None:
    # 2 (n - 1) / n of the buffer crosses each link: 1.5 x 100 MB at 1 GB/s for n = 4.
    assert ring_allreduce_time(100e6, 4, 1e9) == pytest.approx(0.15)
    assert ring_allreduce_time(100e6, 1, 1e9) == 0.0
    with pytest.raises(DataParallelError, match="bandwidth"):
        ring_allreduce_time(1.0, 2, 0.0)
    with pytest.raises(DataParallelError, match="--dp"):
        ring_allreduce_time(1.0, 0, 1.0)


def test_1f1b_hides_the_last_stage_under_the_first_stages_cool_down() -> None:
    # p=2, m=2, unit costs: rank 1's last B ends at 7, rank 0's at 9 (the makespan).
    schedule = build_schedule("1f1b", 2, 2)
    timeline = simulate(schedule, Costs()).timeline
    cost = data_parallel_cost(timeline, schedule.placement, 100.0, replicas=2, bandwidth=50.0)
    assert cost.bytes_per_rank == (100.0, 100.0)
    assert cost.traffic_per_rank == (100.0, 100.0)  # 2 (2 - 1) / 2 of 100 bytes
    assert cost.allreduce_time == (2.0, 2.0)
    assert cost.finish == (11.0, 9.0)  # rank 1: 7 + 2, inside the makespan
    assert cost.pipeline_makespan == 9.0
    assert (cost.step_time, cost.exposed) == (11.0, 2.0)
    assert cost.to_json()["exposed"] == 2.0


def test_zero_bubble_all_reduce_starts_after_the_last_w() -> None:
    schedule = build_schedule("zb-h1", 2, 2)
    timeline = simulate(schedule, Costs()).timeline
    cost = data_parallel_cost(
        timeline, schedule.placement, [100.0, 300.0], replicas=4, bandwidth=100.0
    )
    assert cost.allreduce_time == (1.5, 4.5)
    assert cost.finish == (8.5, 11.5)  # both ranks' last W end at 7
    assert cost.exposed == 4.5


def test_without_bandwidth_only_bytes_count() -> None:
    schedule = build_schedule("interleaved-1f1b", 2, 4, chunks=2)
    timeline = simulate(schedule, Costs()).timeline
    cost = data_parallel_cost(timeline, schedule.placement, [1, 2, 3, 4], replicas=2)
    # Rank 0 holds model stages 0 and 2, rank 1 stages 1 and 3.
    assert cost.bytes_per_rank == (4.0, 6.0)
    assert cost.allreduce_time == (0.0, 0.0)
    assert cost.exposed == 0.0


def test_sizes_must_match_the_model_stages() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    timeline = simulate(schedule, Costs()).timeline
    with pytest.raises(DataParallelError, match="one per model stage"):
        data_parallel_cost(timeline, schedule.placement, [1.0, 2.0, 3.0], replicas=2)


@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    st.integers(2, 8),
    st.floats(0.0, 1e6),
    st.floats(1.0, 1e6),
)
def test_step_time_is_at_least_the_pipeline_and_each_rank_s_all_reduce(
    name: str, replicas: int, nbytes: float, bandwidth: float
) -> None:
    schedule = build_schedule(name, 2, 4, chunks=2 if name == "interleaved-1f1b" else None)
    timeline = simulate(schedule, Costs()).timeline
    cost = data_parallel_cost(
        timeline, schedule.placement, nbytes, replicas=replicas, bandwidth=bandwidth
    )
    assert cost.step_time >= cost.pipeline_makespan
    assert cost.step_time >= max(cost.allreduce_time) - 1e-9
    assert cost.exposed <= max(cost.allreduce_time) + 1e-9
