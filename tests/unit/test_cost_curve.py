"""CostCurve: layer costs measured at several micro-batch sizes, read at any size."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.partition.balance import LayerCost
from pipetrain.partition.cost_curve import CostCurve


def _layer(per_call_f: float, per_call_b: float, size: int) -> LayerCost:
    return LayerCost(
        name="layers.0",
        kind="block",
        forward=per_call_f / size,
        backward=per_call_b / size,
        backward_input=per_call_b / 2 / size,
        backward_weight=per_call_b / 2 / size,
        params=10,
        param_bytes=40,
        activation_bytes_per_sample=100.0,
    )


def test_measured_sizes_are_read_as_measured_and_others_on_the_line_between() -> None:
    curve = CostCurve({2: [_layer(4.0, 8.0, 2)], 8: [_layer(10.0, 26.0, 8)]})
    assert curve.at(2)[0].forward == 2.0 and curve.at(8)[0].backward == 26.0 / 8
    four = curve.at(4)[0]  # a third of the way from 2 to 8: per call 6 and 14
    assert four.forward == pytest.approx(6.0 / 4) and four.backward == pytest.approx(14.0 / 4)
    assert four.backward_input + four.backward_weight == pytest.approx(four.backward)
    # Beyond the largest and below the smallest: the nearest two sizes' line, extended.
    assert curve.at(14)[0].forward == pytest.approx(16.0 / 14)
    assert curve.at(1)[0].forward == pytest.approx(3.0)


def test_a_curve_refuses_no_sizes_mixed_layer_counts_and_size_zero() -> None:
    with pytest.raises(ValueError, match="at least one"):
        CostCurve({})
    with pytest.raises(ValueError, match="layer counts"):
        CostCurve({1: [_layer(1, 1, 1)], 2: [_layer(1, 1, 2)] * 2})
    with pytest.raises(ValueError, match=">= 1"):
        CostCurve({1: [_layer(1, 1, 1)]}).at(0)


def test_the_memory_overhead_is_the_line_through_what_a_step_holds_beyond_the_count() -> None:
    from pipetrain.partition.memory import fit_overhead

    acts, params = 1000.0, 50.0  # per sample; fp32 bytes of the weights
    # Measured: the count (4 x params + acts x size) plus 20% of the activations and 300.
    measured = {s: 4 * params + acts * s * 1.2 + 300 for s in (1, 2, 4, 8)}
    fraction, per_process = fit_overhead({**measured, 16: 0.0}, acts, params)  # 0: unmeasured
    assert fraction == pytest.approx(0.2) and per_process == pytest.approx(300)
    assert fit_overhead({4: measured[4]}, acts, params) == (0.0, 0.0)  # one size: no line
    # Less than the count is no negative overhead.
    assert fit_overhead({1: 10.0, 2: 20.0}, acts, params) == (0.0, 0.0)


def test_the_workspace_is_charged_to_the_micro_batch_in_flight_not_to_every_live_one() -> None:
    from pipetrain.partition.balance import make_partition
    from pipetrain.partition.memory import rank_memory

    # Two stages on two ranks, 100 and 300 bytes of activations a sample; micro-batches of
    # 2. Rank 0 holds 4 live micro-batches (800 bytes at its peak), rank 1 one (600).
    costs = [_layer(1, 1, 1), _layer(1, 1, 1)]
    costs = [replace(costs[0], activation_bytes_per_sample=100.0), costs[1]]
    costs[1] = replace(costs[1], activation_bytes_per_sample=300.0)
    partition = make_partition("uniform", costs, [(0, 1), (1, 2)], [0, 1])
    memory = rank_memory(
        partition, costs, weight_bytes=[40.0, 40.0], peak_activation_bytes=[800.0, 600.0],
        microbatch_size=2, message_bytes=0.0, copies=1, overhead=(0.5, 7.0),
    )  # fmt: skip
    # Half of one micro-batch's activations on the rank's stage, plus the fixed part:
    # the same for 4 live micro-batches as for 1.
    assert [m.workspace for m in memory] == [0.5 * 200 + 7, 0.5 * 600 + 7]
    # Naive model parallel: one action carries all 4 micro-batches.
    naive = rank_memory(
        partition, costs, weight_bytes=[40.0, 40.0], peak_activation_bytes=[800.0, 2400.0],
        microbatch_size=2, message_bytes=0.0, copies=1, overhead=(0.5, 7.0), batch_scale=4,
    )  # fmt: skip
    assert [m.workspace for m in naive] == [0.5 * 800 + 7, 0.5 * 2400 + 7]
