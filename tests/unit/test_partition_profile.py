"""Cost estimates and measurements: parameter counts, saved-activation bytes, sane times."""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.models import PRESETS, LayerSpec, PipelineSpec, get_model_config, model_spec
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.profile import profile_layers


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_estimated_parameters_match_the_built_layers(name: str) -> None:
    config = get_model_config(name)
    estimated = estimate_costs(config, 64)
    for layer, cost in zip(model_spec(config).layers, estimated, strict=True):
        with torch.device("meta"):
            built = sum(p.numel() for p in layer.build().parameters())
        assert (cost.name, cost.kind, cost.params) == (layer.name, layer.kind, built)
        assert cost.param_bytes == 4 * built


def test_estimated_head_of_a_large_vocabulary_outweighs_a_block() -> None:
    costs = estimate_costs(get_model_config("llama3-8b"), 4096)
    assert costs[-1].forward > costs[1].forward
    assert costs[0].forward < costs[1].forward / 100
    assert all(c.backward == pytest.approx(c.backward_input + c.backward_weight) for c in costs)


def test_profile_counts_saved_activations_exactly() -> None:
    # Linear keeps its input (8 floats per sample), tanh its output (16 floats).
    spec = PipelineSpec.from_layers([lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh())])
    for batch in (2, 6):
        (cost,) = profile_layers(spec, torch.randn(batch, 8), device="cpu", repeats=1)
        assert cost.activation_bytes_per_sample == 4 * (8 + 16)
        assert (cost.params, cost.param_bytes) == (8 * 16 + 16, 4 * (8 * 16 + 16))


def test_profile_times_follow_the_work() -> None:
    # About 1000 times the FLOPs: the order survives the noise of a shared machine.
    spec = PipelineSpec.from_layers(
        [
            LayerSpec("light", "block", lambda: nn.Linear(256, 8)),
            LayerSpec(
                "heavy", "block", lambda: nn.Sequential(nn.Linear(8, 1024), nn.Linear(1024, 1024))
            ),
        ]
    )
    light, heavy = profile_layers(spec, torch.randn(128, 256), device="cpu", repeats=3, threads=1)
    assert heavy.forward > 5 * light.forward
    assert heavy.backward > 5 * light.backward
    for cost in (light, heavy):
        assert cost.forward > 0 and cost.backward > 0
        assert cost.backward == pytest.approx(cost.backward_input + cost.backward_weight)
        assert 0 < cost.backward_input <= cost.backward


def test_profile_of_a_tiny_model_has_one_cost_per_layer() -> None:
    config = get_model_config("llama-tiny")
    spec = model_spec(config)
    costs = profile_layers(spec, torch.randint(0, 256, (2, 16)), device="cpu", repeats=1, threads=1)
    assert [c.name for c in costs] == [layer.name for layer in spec.layers]
    assert costs[0].backward_input == 0.0  # token ids have no gradient
    estimated = estimate_costs(config, 16)
    for measured, guess in zip(costs, estimated, strict=True):
        assert measured.params == guess.params
    # The estimate counts the same saved tensors; it charges a per-micro-batch tensor of
    # attention to every sample, so it is a little high at a micro-batch of 2.
    for i in (1, len(costs) - 1):
        assert costs[i].activation_bytes_per_sample == pytest.approx(
            estimated[i].activation_bytes_per_sample, rel=0.01
        )


@functools.cache
def _profiled_and_estimated(name: str) -> tuple[list[Any], list[Any]]:
    """A tiny preset's per-layer costs, profiled (micro-batch 2 x 16) and estimated."""
    config = get_model_config(name)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    costs = profile_layers(model_spec(config), ids, device="cpu", repeats=1, threads=1)
    return costs, estimate_costs(config, 16)


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "moe-tiny"])
def test_profiled_output_gradients_held_from_i_to_w_match_the_estimate(name: str) -> None:
    # A split backward queues every linear's output gradient until W: the profile counts
    # the linears' outputs, the estimate counts them from the shapes (GQA's narrower k and
    # v, a MoE block's router and the k experts each token goes to).
    costs, estimated = _profiled_and_estimated(name)
    assert costs[0].deferred_bytes_per_sample == estimated[0].deferred_bytes_per_sample == 0
    for measured, guess in zip(costs[1:], estimated[1:], strict=True):
        assert measured.deferred_bytes_per_sample > 0
        assert measured.deferred_bytes_per_sample == pytest.approx(
            guess.deferred_bytes_per_sample, rel=1e-9
        ), measured.name


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "moe-tiny"])
def test_profiled_activations_freed_at_i_match_the_estimate(name: str) -> None:
    # The end of a split backward's I lets go of every kept tensor but the linears'
    # inputs, which W's weight products need: the profile tells them apart by storage, the
    # estimate from the shapes. The lookup is no linear: all its kept ids go at I.
    costs, estimated = _profiled_and_estimated(name)
    for embed in (costs[0], estimated[0]):
        assert embed.freed_at_input_bytes_per_sample == embed.activation_bytes_per_sample > 0
    for measured, guess in zip(costs[1:], estimated[1:], strict=True):
        assert 0 < measured.freed_at_input_bytes_per_sample < measured.activation_bytes_per_sample
        assert measured.freed_at_input_bytes_per_sample == pytest.approx(
            guess.freed_at_input_bytes_per_sample, rel=0.01
        ), measured.name


def _posts_late(queue: Any, delay: float) -> None:
    time.sleep(delay)
    queue.put(("ok", delay))


def _dies_silently(queue: Any, delay: float) -> None:
    os._exit(9)


def test_a_slow_profile_is_waited_for_and_a_silent_death_is_one_line() -> None:
    # The llama-wide profile on 4 processes of 2 cores outlived a fixed 900 s total and
    # ended in a bare queue.Empty traceback; the parent now waits while its children live.
    from pipetrain.partition.profile_run import _collect

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    slow = [ctx.Process(target=_posts_late, args=(queue, 0.3)) for _ in range(2)]
    for child in slow:
        child.start()
    assert _collect(queue, slow, poll_s=0.05) == [("ok", 0.3), ("ok", 0.3)]
    for child in slow:
        child.join()
    dead = [ctx.Process(target=_dies_silently, args=(queue, 0.0))]
    dead[0].start()
    with pytest.raises(RuntimeError, match="1 of 1 ended without a result"):
        _collect(queue, dead, poll_s=0.05)
    dead[0].join()
