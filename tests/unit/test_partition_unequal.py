"""Unequal ranks: per-rank speed and memory in the balancer, the simulator and the plan.

A stage on a rank of speed 0.5 costs twice its layers' time, a rank with less memory has
its own limit; the exact balancer's answer is checked against brute force over every
split, with one stage per rank and with two (V placement, the coupled search).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.errors import InputError
from pipetrain.partition.balance import LayerCost, MemoryModel, split_by_cost
from pipetrain.partition.planner import make_plan
from pipetrain.schedules import registry
from pipetrain.schedules.execution import Costs
from pipetrain.sim.ranks import with_rank_speeds
from pipetrain.sim.simulator import simulate


def _block(time: float, params: int = 0, act: float = 0.0) -> LayerCost:
    return LayerCost(
        "block", "block", time / 3, 2 * time / 3, time / 3, time / 3, params, params, act
    )


def _splits(n_layers: int, n_stages: int) -> list[list[tuple[int, int]]]:
    return [
        list(itertools.pairwise([0, *cuts, n_layers]))
        for cuts in itertools.combinations(range(1, n_layers), n_stages - 1)
    ]


def _slowest(
    costs: Sequence[LayerCost], split: list[tuple[int, int]], ranks: Sequence[int], speeds
) -> float:
    return max(sum(c.time for c in costs[i:j]) / speeds[ranks[s]] for s, (i, j) in enumerate(split))


def _layers(part) -> list[int]:
    return [len(stage) for stage in part.stages]


def test_a_slow_rank_gets_fewer_layers() -> None:
    costs = [_block(1.0) for _ in range(16)]
    assert _layers(split_by_cost(costs, (0, 1, 2, 3))) == [4, 4, 4, 4]
    part = split_by_cost(costs, (0, 1, 2, 3), speeds=(1, 1, 0.5, 1))
    # Times 5, 5, 1/0.5 = 2, 5: the slowest stage takes 5 instead of 4 / 0.5 = 8. (5, 5, 2,
    # 4 is as slow at its slowest; the least sum of squared times breaks the tie, and the
    # layer spared on the slow rank saves time.)
    assert _layers(part) == [5, 5, 1, 5]
    # Speeds of 1 change nothing; a uniformly faster pipeline neither.
    for speeds in ((1, 1, 1, 1), (3, 3, 3, 3)):
        assert _layers(split_by_cost(costs, (0, 1, 2, 3), speeds=speeds)) == [4, 4, 4, 4]


def test_a_small_rank_gets_fewer_layers() -> None:
    costs = [_block(1.0, params=10) for _ in range(8)]
    memory = MemoryModel(
        limit_bytes=100.0,
        microbatch_size=1,
        live=(1, 1),
        state_factor=1.0,
        rank_limit_bytes=(100.0, 30.0),
    )
    assert memory.limit_of(1) == 30.0
    assert _layers(split_by_cost(costs, (0, 1), memory)) == [5, 3]
    tight = MemoryModel(100.0, 1, (1, 1), 1.0, rank_limit_bytes=(40.0, 30.0))
    with pytest.raises(InputError, match=r"per-rank memory limits.*--rank-memory"):
        split_by_cost(costs, (0, 1), tight)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=5, max_size=9),
    st.sampled_from([(0, 1, 2), (0, 1, 1, 0), (0, 1, 2, 2, 1, 0)]),
    st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0]), min_size=3, max_size=3),
)
def test_the_split_is_the_fastest_there_is(
    times: list[int], ranks: tuple[int, ...], speeds: list[float]
) -> None:
    if len(ranks) > len(times):
        return
    costs = [_block(float(t)) for t in times]
    speeds = speeds[: max(ranks) + 1]
    part = split_by_cost(costs, ranks, speeds=speeds)
    bounds = [(stage[0], stage[-1] + 1) for stage in part.stages]
    best = min(_slowest(costs, sp, ranks, speeds) for sp in _splits(len(costs), len(ranks)))
    assert _slowest(costs, bounds, ranks, speeds) == pytest.approx(best)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=5, max_size=8),
    st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=2, max_size=2),
    st.lists(st.integers(20, 80), min_size=2, max_size=2),
)
def test_speed_and_memory_together_on_a_v(
    layers: list[tuple[int, int]], speeds: list[float], limits: list[int]
) -> None:
    # Two stages per rank: the limits couple them and the branch-and-bound search decides.
    ranks = (0, 1, 1, 0)
    costs = [_block(float(t), params=p) for t, p in layers]
    memory = MemoryModel(
        float(max(limits)), 1, (1, 1, 1, 1), 1.0, rank_limit_bytes=tuple(map(float, limits))
    )

    def fits(split: list[tuple[int, int]]) -> bool:
        used = [0.0, 0.0]
        for s, (i, j) in enumerate(split):
            used[ranks[s]] += memory.stage_bytes(costs, s, i, j)
        return all(u <= lim for u, lim in zip(used, limits, strict=True))

    feasible = [sp for sp in _splits(len(costs), 4) if fits(sp)]
    if not feasible:
        with pytest.raises(InputError, match="--rank-memory"):
            split_by_cost(costs, ranks, memory, speeds)
        return
    part = split_by_cost(costs, ranks, memory, speeds)
    bounds = [(stage[0], stage[-1] + 1) for stage in part.stages]
    assert fits(bounds)
    best = min(_slowest(costs, sp, ranks, speeds) for sp in feasible)
    assert _slowest(costs, bounds, ranks, speeds) == pytest.approx(best)


def test_the_simulator_runs_a_slow_rank_slower() -> None:
    schedule = registry.build_schedule("1f1b", 4, 8)
    costs = with_rank_speeds(Costs(), schedule.placement, (1, 1, 0.5, 1))
    assert costs.forward == (1, 1, 2, 1) and costs.backward == (2, 2, 4, 2)
    # The slow rank is the bottleneck, busy 8 x (F + B) = 48 after the forwards of ranks 0
    # and 1 (2), waiting once for rank 3's first F and B beyond its one warm-up forward (1),
    # then the last backwards of ranks 1 and 0 (4): 55, against 33 with equal ranks.
    assert simulate(schedule).makespan == 33
    assert simulate(schedule, costs).makespan == pytest.approx(2 + 48 + 1 + 4)
    # On a V, a rank's two stages slow down together.
    v = registry.build_schedule("v-half", 2, 4)
    assert with_rank_speeds(Costs(), v.placement, (1, 0.5)).forward == (1, 2, 2, 1)
    # Chimera's replicas: a model stage runs at its slowest holder's speed.
    chimera = registry.build_schedule("chimera", 4, 4)
    assert with_rank_speeds(Costs(), chimera.placement, (1, 1, 1, 0.5)).forward == (2, 1, 1, 2)


@pytest.mark.parametrize(
    ("speeds", "problem"),
    [((1, 1, 1), "gives 3 speeds for 4 ranks"), ((1, 0, 1, 1), "must be a number > 0")],
)
def test_bad_speeds_are_one_line(speeds: tuple[float, ...], problem: str) -> None:
    schedule = registry.build_schedule("1f1b", 4, 8)
    with pytest.raises(InputError, match=problem) as info:
        with_rank_speeds(Costs(), schedule.placement, speeds)
    assert "\n" not in str(info.value)


def test_the_plan_balances_for_the_ranks_and_says_so() -> None:
    costs = [_block(1e-3, params=1000, act=1.0) for _ in range(16)]

    def plan(**kw):
        return make_plan(
            costs,
            schedule_for=lambda m: registry.build_schedule("1f1b", 4, m),
            batch_size=8,
            microbatches=8,
            method="profile",
            **kw,
        )

    even, slow = plan(), plan(rank_speed=(1, 1, 0.5, 1))
    assert [len(s.layers) for s in slow.stages] == [5, 5, 1, 5]
    assert slow.rank_speed == (1, 1, 0.5, 1) and slow.to_json()["rank_speed"] == [1, 1, 0.5, 1]
    # The even split on these ranks is slower than the split made for them.
    blocks = [len(s.layers) for s in even.stages]
    on_slow = plan(rank_speed=(1, 1, 0.5, 1), split=blocks)
    assert slow.step_time < on_slow.step_time
    assert even.step_time < slow.step_time  # a slower rank never speeds anything up
    # A small rank: its own limit.
    held = max(even.rank_bytes)
    small = plan(rank_memory=(held * 2, held * 2, held * 0.7, held * 2))
    assert len(small.stages[2].layers) < 4
    assert small.limits is not None and small.rank_bytes[2] <= small.limits[2]
    with pytest.raises(InputError, match="gives 3 sizes for 4 ranks"):
        plan(rank_memory=(held, held, held))
