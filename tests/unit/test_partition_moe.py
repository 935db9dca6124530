"""The planner's counts of mixture-of-experts models: parameters (all, per ep rank, active),
FLOPs and saved activations, checked against the built modules and the profiler, and the
one-line refusals of an ep that does not fit (docs/memory_model.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import PartitionError
from pipetrain.partition.estimate import (
    block_params,
    check_expert_parallel,
    estimate_costs,
    model_counts,
)
from pipetrain.partition.experts import moe_counts
from pipetrain.partition.profile import profile_layers


def _built(config: ModelConfig, shard: tuple[int, int] | None = None) -> list[int]:
    """Parameters of each pipeline layer as built (meta device)."""
    counts = []
    for layer in model_spec(config, expert_shard=shard).layers:
        with torch.device("meta"):
            counts.append(sum(p.numel() for p in layer.build().parameters()))
    return counts


@pytest.mark.parametrize(
    ("name", "ep"),
    [("moe-tiny", 1), ("moe-tiny", 2), ("moe-tiny", 4), ("moe-default", 2), ("moe-default", 8)],
)
def test_per_rank_parameters_equal_every_ep_ranks_built_layers(name: str, ep: int) -> None:
    config = get_model_config(name)
    estimated = [c.params for c in estimate_costs(config, 16, ep=ep)]
    for rank in range(ep):
        assert estimated == _built(config, (rank, ep) if ep > 1 else None)


def test_interleaved_moe_blocks_with_shared_experts_are_counted_block_by_block() -> None:
    # Dense first, then every other block MoE; shared experts and a sigmoid router.
    config = dataclasses.replace(
        get_model_config("moe-tiny"),
        n_layers=5,
        dense_first=1,
        moe_every=2,
        n_shared_experts=2,
        router="sigmoid",
    )
    assert config.moe_blocks == (2, 4)
    assert [c.params for c in estimate_costs(config, 16, ep=2)] == _built(config, (1, 2))
    dense = block_params(config, 0)
    assert block_params(config, 1) == dense and block_params(config, 2) > dense


@pytest.mark.parametrize("name", ["moe-tiny", "moe-default"])
def test_total_and_active_parameters_of_the_whole_built_model(name: str) -> None:
    config = get_model_config(name)
    model = build_full_model(model_spec(config), seed=0, device="meta")
    total = sum(p.numel() for p in model.parameters())
    # One token uses its top_k experts: every expert past the first top_k is idle for it.
    idle = sum(
        p.numel()
        for n, p in model.named_parameters()
        if ".moe.experts." in n and int(n.split(".moe.experts.")[1].split(".")[0]) >= config.top_k
    )
    counts = model_counts(config)
    assert (counts.total, counts.active) == (total, total - idle)
    assert counts.moe_blocks == config.n_layers
    assert counts.forward_flops_per_token == 2 * counts.active


def test_published_sizes_of_mixtral_and_deepseek_v3() -> None:
    mixtral = model_counts(get_model_config("mixtral-8x7b"))
    assert mixtral.total == pytest.approx(46.7e9, rel=0.002)  # 46.70 B
    assert mixtral.active == pytest.approx(12.9e9, rel=0.002)  # 12.88 B
    # DeepSeek-V3 (671 B, 37 B active): GQA with 128 kv heads in place of MLA counts
    # 4 C^2 = 205.5 M attention parameters a block against MLA's 187.1 M (docs).
    deepseek = model_counts(get_model_config("deepseek-v3"))
    mla_excess = 61 * (4 * 7168**2 - 187_105_280)
    assert deepseek.total - mla_excess == pytest.approx(671e9, rel=0.002)
    assert deepseek.active - mla_excess == pytest.approx(37e9, rel=0.02)  # 37.55 B
    assert deepseek.moe_blocks == 58


@pytest.mark.parametrize(
    "change",
    [{}, {"router": "sigmoid", "n_shared_experts": 1}, {"router_norm_topk": False, "top_k": 3}],
)
def test_moe_block_activations_equal_what_autograd_saves(change: dict[str, object]) -> None:
    config = dataclasses.replace(get_model_config("moe-tiny"), **change)
    spec = model_spec(config)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    measured = profile_layers(spec, ids, device="cpu", repeats=1, threads=1)
    estimated = estimate_costs(config, 16)
    for i in range(1, 1 + config.n_layers):
        assert measured[i].activation_bytes_per_sample == estimated[i].activation_bytes_per_sample


def test_a_moe_block_computes_its_active_experts_only() -> None:
    # moe-default: 2 of 8 experts of 192 = the dense 384 of the same width, plus the router.
    moe = get_model_config("moe-default")
    dense = dataclasses.replace(moe, n_experts=0, ffn_hidden=384)
    t = 128
    m, d = estimate_costs(moe, t)[1], estimate_costs(dense, t)[1]
    router = 2.0 * t * moe.d_model * moe.n_experts / 1e11  # its matmul, at the default FLOP/s
    assert m.forward == pytest.approx(d.forward + router, rel=1e-12)
    assert m.backward_weight == pytest.approx(d.backward_weight + router, rel=1e-12)
    # Under tp the experts are whole on every tp rank: only attention's share shrinks.
    tp2 = estimate_costs(moe, t, tp=2)[1]
    moe_flops = 2.0 * t * moe_counts(moe).active / 1e11
    assert tp2.backward_weight == pytest.approx((m.backward_weight - moe_flops) / 2 + moe_flops)


def test_ep_adds_the_all_to_alls_to_forward_and_input_gradient_only() -> None:
    config = get_model_config("moe-default")
    t, bandwidth = 128, 1e9
    plain = estimate_costs(config, t)
    sharded = estimate_costs(config, t, ep=4, ep_bandwidth=bandwidth)
    # Each all-to-all: T tokens x top_k x C fp32 numbers, 3/4 of them to the other ranks.
    alltoall = t * 2 * 128 * 4 * 3 / 4 / bandwidth
    for p, s in zip(plain[1:-1], sharded[1:-1], strict=True):
        assert s.forward == pytest.approx(p.forward + 2 * alltoall, rel=1e-12)
        assert s.backward_input == pytest.approx(p.backward_input + 2 * alltoall, rel=1e-12)
        assert s.backward_weight == p.backward_weight
        assert s.activation_bytes_per_sample == p.activation_bytes_per_sample
    assert (sharded[0], sharded[-1]) == (plain[0], plain[-1])
    # Without a bandwidth the all-to-alls take no time.
    assert [c.forward for c in estimate_costs(config, t, ep=4)] == [c.forward for c in plain]


@pytest.mark.parametrize(
    ("name", "ep", "words"),
    [
        ("llama-tiny", 2, "--ep 2 shards experts, but model 'llama-tiny' is dense"),
        ("moe-default", 3, "has 8 experts per MoE layer, which do not split over --ep 3"),
        ("moe-tiny", 0, "--ep 0: give a whole number >= 1"),
    ],
)
def test_an_ep_that_does_not_fit_is_refused_in_one_line(name: str, ep: int, words: str) -> None:
    with pytest.raises(PartitionError, match=words) as caught:
        check_expert_parallel(get_model_config(name), ep)
    assert "\n" not in str(caught.value)


def test_sequence_parallelism_with_moe_blocks_is_refused() -> None:
    with pytest.raises(PartitionError, match="not supported with mixture-of-experts"):
        estimate_costs(get_model_config("moe-tiny"), 16, tp=2, sequence_parallel=True)
