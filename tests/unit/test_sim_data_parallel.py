"""The data-parallel all-reduce on simulated pipeline timelines (pure, no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.schedules.execution import Costs
from pipetrain.schedules.registry import build_schedule
from pipetrain.sim import simulate
from pipetrain.sim.data_parallel import (
    DataParallelError,
    data_parallel_cost,
    ring_allreduce_time,
    ring_gather_time,
    sharded_cost,
)


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


def test_ring_gather_time_is_half_an_all_reduce() -> None:
    # (n - 1) / n of the buffer crosses each link: 0.75 x 100 MB at 1 GB/s for n = 4.
    assert ring_gather_time(100e6, 4, 1e9) == pytest.approx(0.075)
    assert ring_gather_time(100e6, 1, 1e9) == 0.0
    with pytest.raises(DataParallelError, match="bandwidth"):
        ring_gather_time(1.0, 2, -1.0)


def test_sharded_1f1b_gathers_delay_the_first_forward_of_rank_0_only() -> None:
    # p=2, m=2, unit costs, 100 bytes per stage, dp=2 at 50 bytes per unit: a gather or a
    # reduce-scatter moves 50 bytes (1 unit). Rank 0's F0 waits for its gather (starts at
    # 1, not 0), which shifts the whole pipeline by 1 (ends at 10, not 9); rank 1's gather
    # ends at 1, before its F0 can start anyway (2). Reduce-scatters after the last B:
    # rank 0 10 + 1 = 11, rank 1 8 + 1 = 9.
    schedule = build_schedule("1f1b", 2, 2)
    cost = sharded_cost(schedule, Costs(), 100.0, replicas=2, bandwidth=50.0)
    assert cost.bytes_per_rank == (100.0, 100.0)
    assert cost.gather_traffic_per_rank == (50.0, 50.0)
    assert cost.reduce_scatter_traffic_per_rank == (50.0, 50.0)
    assert cost.traffic_per_rank == (100.0, 100.0)  # as much as one all-reduce
    assert cost.gather_time == (1.0, 1.0)
    assert cost.reduce_scatter_time == (1.0, 1.0)
    assert cost.finish == (11.0, 9.0)
    assert (cost.pipeline_makespan, cost.gathered_makespan) == (9.0, 10.0)
    assert (cost.step_time, cost.exposed, cost.gather_delay) == (11.0, 2.0, 1.0)
    assert cost.to_json() == {
        "dp": 2,
        "sharded": True,
        "bytes_per_rank": [100.0, 100.0],
        "traffic_per_rank": [100.0, 100.0],
        "all_gather_traffic_per_rank": [50.0, 50.0],
        "reduce_scatter_traffic_per_rank": [50.0, 50.0],
        "all_gather_time": [1.0, 1.0],
        "reduce_scatter_time": [1.0, 1.0],
        "gather_delay": 1.0,
        "step_time": 11.0,
        "exposed": 2.0,
    }


def test_a_gather_longer_than_the_warm_up_wait_delays_the_later_rank() -> None:
    # Rank 1's stage is 3x larger: its gather takes 3 units, its F0 could start at 2 (after
    # rank 0's held F0): 1 of the 3 hides, F0 runs 3-4, B0 4-6, F1 6-7, B1 7-9; rank 0's
    # B0 6-8, B1 9-11. Rank 1's reduce-scatter (3) runs 9-12, rank 0's (1) 11-12.
    schedule = build_schedule("1f1b", 2, 2)
    cost = sharded_cost(schedule, Costs(), [100.0, 300.0], replicas=2, bandwidth=50.0)
    assert cost.gather_time == (1.0, 3.0)
    assert cost.reduce_scatter_time == (1.0, 3.0)
    assert cost.gathered_makespan == 11.0
    assert cost.finish == (12.0, 12.0)
    assert (cost.step_time, cost.exposed, cost.gather_delay) == (12.0, 3.0, 2.0)


def test_sharded_zero_bubble_reduce_scatters_after_the_last_w() -> None:
    # ZB-H1, p=2, m=2, unit costs: 7 without gathers; rank 0's F0 held to 1 moves every
    # action by 1 (8); both ranks' last W end at 8, so both reduce-scatters end at 9.
    schedule = build_schedule("zb-h1", 2, 2)
    plain = simulate(schedule, Costs())
    cost = sharded_cost(schedule, Costs(), 100.0, replicas=2, bandwidth=50.0)
    assert cost.pipeline_makespan == plain.makespan == 7.0
    assert cost.gathered_makespan == 8.0
    assert cost.finish == (9.0, 9.0)
    assert cost.exposed == 2.0


def test_sharded_gathers_run_in_first_forward_order_on_the_rank_s_link() -> None:
    # Interleaved, rank 0 holds model stages 0 and 2 (1 and 3 bytes), rank 1 stages 1 and
    # 3 (2 and 4 bytes); dp=2 at 1 byte per unit: rank 0 gathers 0.5 then 1.5 units.
    schedule = build_schedule("interleaved-1f1b", 2, 4, chunks=2)
    cost = sharded_cost(schedule, Costs(), [1.0, 2.0, 3.0, 4.0], replicas=2, bandwidth=1.0)
    assert cost.bytes_per_rank == (4.0, 6.0)
    assert cost.gather_time == (2.0, 3.0)
    assert cost.reduce_scatter_time == (2.0, 3.0)
    assert cost.step_time >= cost.gathered_makespan >= cost.pipeline_makespan


def test_sharded_without_bandwidth_counts_bytes_only() -> None:
    schedule = build_schedule("1f1b", 2, 4)
    cost = sharded_cost(schedule, Costs(), 80.0, replicas=4)
    assert cost.traffic_per_rank == (120.0, 120.0)  # 2 x 3/4 of 80
    assert cost.gather_time == cost.reduce_scatter_time == (0.0, 0.0)
    assert cost.step_time == cost.pipeline_makespan == simulate(schedule, Costs()).makespan
    assert cost.exposed == 0.0


def test_sharded_refuses_what_the_runtime_refuses() -> None:
    with pytest.raises(DataParallelError, match="replicates stages"):
        sharded_cost(build_schedule("chimera", 2, 2), Costs(), 1.0, replicas=2)
    with pytest.raises(DataParallelError, match="--dp"):
        sharded_cost(build_schedule("1f1b", 2, 2), Costs(), 1.0, replicas=0)


@given(
    st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    st.integers(2, 8),
    st.floats(0.0, 1e6),
    st.floats(1.0, 1e6),
)
def test_sharded_step_time_bounds(name: str, replicas: int, nbytes: float, bw: float) -> None:
    schedule = build_schedule(name, 2, 4, chunks=2 if name == "interleaved-1f1b" else None)
    cost = sharded_cost(schedule, Costs(), nbytes, replicas=replicas, bandwidth=bw)
    # Holding forwards back never makes the pipeline shorter, and the link carries every
    # gather and reduce-scatter of a rank one after another.
    assert cost.gathered_makespan >= cost.pipeline_makespan
    for rank in range(2):
        link = cost.gather_time[rank] + cost.reduce_scatter_time[rank]
        assert cost.step_time >= link - 1e-9
    # At worst the gathers delay everything by the longest gather and the reduce-scatters
    # add the longest one after the pipeline.
    assert cost.exposed <= max(cost.gather_time) + max(cost.reduce_scatter_time) + 1e-6
