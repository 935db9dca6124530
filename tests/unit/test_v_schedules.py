"""V-Half and V-Min (pipetrain.schedules.v_shape) against the controllable-memory paper.

Peak activations: Qi et al. give V-Min ``(p+4)//3`` and V-Half ``(p+2)//2`` micro-batches
of a 1F1B stage's activations, against 1F1B's ``p`` (the activation-memory row of the
table in the authors' public demo of the paper). The simulator counts chunk activations
(a V stage is half a 1F1B stage), so it must report twice those numbers. Bubbles: the
same table gives bubble rates of about ``p/m`` (1F1B), ``2p/(3m)`` (V-Min) and
``p/(2m)`` (V-Half); without the paper's warm-up reordering ours come out at about 0.66
and 0.58 of 1F1B's (docs/v_schedules.md).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedules import registry
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.grid import format_timeline
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.v_shape import PERIOD, block_peak, lifespans, v_half, v_min
from pipetrain.schedules.validate import validate
from pipetrain.sim.simulator import simulate

# A V stage is half a 1F1B stage: half the unit costs, so bubbles compare in one unit.
HALF = Costs(forward=0.5, backward=1.0, backward_input=0.5, backward_weight=0.5)
PAPER_PEAK = {"v-min": lambda p: (p + 4) // 3, "v-half": lambda p: (p + 2) // 2}
BUILD = {"v-min": v_min, "v-half": v_half}


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_the_validator_accepts_them(name: str, p: int) -> None:
    for m in (1, 2, p, 2 * p + 1, 4 * p):
        schedule = registry.build_schedule(name, p, m)
        validate(schedule)
        validate(lower(schedule))
        assert schedule.placement.kind == "v"
        assert schedule.splits_backward
        computed = sum(len(row) for row in schedule.actions)
        assert computed == 3 * 2 * p * m  # F, I and W of every stage and micro-batch


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [*range(2, 17), 24, 32])
def test_peak_activations_are_the_papers(name: str, p: int) -> None:
    r = simulate(BUILD[name](p, 4 * p))
    assert max(r.peak_activations) == 2 * PAPER_PEAK[name](p)
    # The lifespan argument bounds every rank: sum over its stages of ceil(life / T).
    assert max(r.peak_activations) <= block_peak(name, p)
    # Fewer micro-batches never hold more.
    assert max(simulate(BUILD[name](p, p)).peak_activations) <= 2 * PAPER_PEAK[name](p)


@pytest.mark.parametrize("p", [4, 8, 16, 32])
def test_a_half_and_a_third_of_1f1b(p: int) -> None:
    one = max(simulate(registry.build_schedule("1f1b", p, 4 * p)).peak_activations)
    assert one == p
    half = max(simulate(v_half(p, 4 * p)).peak_activations) / 2
    third = max(simulate(v_min(p, 4 * p)).peak_activations) / 2
    assert half <= one / 2 + 1
    assert third <= one / 3 + 4 / 3


@pytest.mark.parametrize("name", ["v-half", "v-min"])
@pytest.mark.parametrize("p", [3, 4, 8, 12])
def test_the_v_balances_lifespans_across_ranks(name: str, p: int) -> None:
    # Rank 0's first stage lives longest and its last stage shortest; the sums stay
    # within one period of each other, which is why every rank peaks alike.
    lives = lifespans(name, p)
    assert lives[0][0] == max(life for life, _ in lives)
    assert lives[0][1] == min(life for _, life in lives)
    sums = [a + b for a, b in lives]
    assert max(sums) - min(sums) <= PERIOD


@pytest.mark.parametrize("p", [3, 4, 6, 8, 12, 16])
def test_bubbles_order_1f1b_v_min_v_half_zb_h1(p: int) -> None:
    m = 4 * p

    def bubble(name: str, costs: Costs | None = None) -> float:
        return simulate(registry.build_schedule(name, p, m), costs).bubble.per_rank_span_time

    one, zb = bubble("1f1b"), bubble("zb-h1")
    vmin, vhalf = bubble("v-min", HALF), bubble("v-half", HALF)
    assert one > vmin > vhalf > zb
    if p >= 8:  # about 2/3 and 1/2 of 1F1B's (the paper's 2p/3m and p/2m against p/m)
        assert 0.6 < vmin / one < 0.7
        assert 0.5 < vhalf / one < 0.62


def test_exact_timelines_p2_m3() -> None:
    half = format_timeline(replay(v_half(2, 3), Costs()))
    assert half.splitlines() == [
        "rank 0 | 0F0 .   .   3F0 3I0 0F1 3W0 .   3F1 3I1 0F2 0I0 0W0 3W1 3F2 3I2 0I1 0W1 "
        "3W2 0I2 0W2",
        "rank 1 | .   1F0 2F0 .   .   2I0 1F1 2F1 1I0 1W0 2W0 2I1 1F2 2F2 1I1 1W1 2W1 2I2 1I2 "
        "1W2 2W2",
    ]
    least = format_timeline(replay(v_min(2, 3), Costs()))
    assert least.splitlines()[0] == (
        "rank 0 | 0F0 .   .   3F0 3I0 3W0 0F1 0I0 0W0 3F1 3I1 3W1 0F2 0I1 0W1 3F2 3I2 3W2 .   "
        "0I2 0W2"
    )


def test_refusals_are_one_line() -> None:
    spec = registry.get_spec("v-min")
    assert spec.check(0, 4) == "v-min needs --pp >= 1 (got 0): use 1 or more pipeline ranks"
    assert registry.get_spec("v-half").check(2, 0) == (
        "v-half needs --microbatches >= 1 (got 0): use 1 or more micro-batches"
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 24), st.sampled_from(["v-half", "v-min"]))
def test_any_size_validates_within_the_papers_peak(p: int, m: int, name: str) -> None:
    schedule = BUILD[name](p, m)
    validate(schedule)
    assert max(simulate(schedule).peak_activations) <= 2 * PAPER_PEAK[name](p)
