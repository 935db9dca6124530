"""`plan --auto --balance profile`'s tp layers: the measured step ratio sets their total,
the estimate keeps their spread (pipetrain.cli.plan_profile); no processes here."""

from __future__ import annotations

import math

import pytest

from pipetrain.cli.plan_profile import ratio_at, scaled_to_ratio, tp_ratio_said, tp_sizes_to_time
from pipetrain.partition.balance import LayerCost


def _layer(kind: str, forward: float, backward: float) -> LayerCost:
    return LayerCost(kind, kind, forward, backward, backward / 2, backward / 2, 10, 40, 8.0)


def test_the_tp_layers_sum_to_the_ratio_times_tp1_and_keep_their_spread() -> None:
    tp1 = [_layer("embedding", 1.0, 1.0), _layer("block", 3.0, 5.0), _layer("head", 1.0, 1.0)]
    estimate = [_layer("embedding", 0.5, 0.5), _layer("block", 1.0, 3.0), _layer("head", 0.5, 0.5)]
    out = scaled_to_ratio(estimate, tp1, 0.9)  # total 12 -> 10.8; the estimate's is 6
    assert sum(c.time for c in out) == pytest.approx(0.9 * 12.0)
    factor = 10.8 / 6.0
    for got, was in zip(out, estimate, strict=True):
        assert got.forward == pytest.approx(was.forward * factor)
        assert got.backward == pytest.approx(was.backward * factor)
        assert got.backward_input == pytest.approx(was.backward_input * factor)
        assert got.backward_weight == pytest.approx(was.backward_weight * factor)
        assert (got.kind, got.params, got.param_bytes) == (was.kind, was.params, was.param_bytes)
    # Nothing to scale: the estimate stands.
    assert scaled_to_ratio([_layer("block", 0.0, 0.0)], tp1, 2.0) == [_layer("block", 0.0, 0.0)]


def test_the_ratio_is_read_at_the_size_or_off_the_line_in_log_size_for_that_degree() -> None:
    ratios = {(2, 1): 3.0, (2, 4): 2.0, (2, 8): 1.5, (4, 2): 5.0}
    assert ratio_at(ratios, 2, 4) == 2.0
    assert ratio_at(ratios, 2, 16) == 1.5  # beyond the largest: its ratio
    assert ratio_at(ratios, 2, 2) == pytest.approx(2.5)  # halfway from 1 to 4 in log size
    assert ratio_at(ratios, 2, 6) == pytest.approx(2.0 - 0.5 * (math.log2(6) - 2))
    assert ratio_at(ratios, 4, 32) == 5.0
    assert ratio_at(ratios, 4, 1) == 5.0
    assert ratio_at(ratios, 8, 1) is None  # that degree unmeasured: the estimate stays
    assert ratio_at({}, 2, 1) is None


def test_a_degree_is_timed_at_its_smallest_largest_and_middle_sizes() -> None:
    assert tp_sizes_to_time([1, 2, 4, 8, 16, 32]) == [1, 8, 32]  # sqrt(32) ~ 5.66: 8 nearer in log
    assert tp_sizes_to_time([32, 2, 8]) == [2, 8, 32]
    assert tp_sizes_to_time([4, 4]) == [4]
    assert tp_sizes_to_time([2, 4, 8, 16]) == [2, 8, 16]  # sqrt(32) ~ 5.66: 8 a hair nearer


def test_the_source_line_says_what_tp_measured() -> None:
    said = tp_ratio_said({(2, 1): 2.5, (2, 2): 2.25, (4, 1): 3.0})
    assert "; tp 2 measured: a step 2.50x the tp 1 step at micro-batch 1, 2.25x at 2" in said
    assert "; tp 4 measured: a step 3.00x the tp 1 step at micro-batch 1" in said
    assert tp_ratio_said({}) == ""
