"""The mixture-of-experts layer against plain arithmetic: routing, the auxiliary loss's
gradient on the main loss's scale, capacity drops, records under recomputation, weights
independent of which experts a rank holds, and the loss-free bias."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from pipetrain.models import ModelConfigError, build_full_model, get_model_config, model_spec
from pipetrain.models.moe import MoEFeedForward, moe_layers
from pipetrain.runtime import build_pipeline
from pipetrain.train.plan import block_split
from pipetrain.train.stage_options import apply_stage_options

TINY = get_model_config("moe-tiny", aux_loss_coef=0.1)


def _layer(config=TINY, seed: int = 0) -> MoEFeedForward:
    model = build_full_model(model_spec(config), seed=seed, device="cpu")
    return model.get_submodule("layers.0.moe")


def _by_token(layer: MoEFeedForward, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Each token through its experts one at a time, with the router's weights."""
    logits = layer.gate(x).float()
    scores = logits.softmax(-1) if layer.router == "softmax" else logits.sigmoid()
    choice = scores if layer.expert_bias is None else scores + layer.expert_bias
    top = choice.topk(layer.top_k, dim=-1).indices
    used = [0] * layer.n_experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights = scores[t, top[t]]
        if layer.norm_topk:
            weights = weights / weights.sum()
        for j, e in enumerate(top[t].tolist()):
            used[e] += 1
            if capacity is not None and used[e] > capacity:
                continue
            out[t] += weights[j] * layer.experts[str(e)](x[t : t + 1])[0]
    if layer.shared is not None:
        out = out + layer.shared(x)
    return out


@pytest.mark.parametrize(
    "options",
    [{}, {"router": "sigmoid", "n_shared_experts": 1}, {"router_norm_topk": False, "top_k": 1}],
)
def test_routing_equals_each_token_through_its_experts(options: dict) -> None:
    layer = _layer(dataclasses.replace(TINY, **options))
    x = torch.randn(24, TINY.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(layer(x), _by_token(layer, x), atol=1e-6)


def test_capacity_drops_the_overflow_in_token_order_and_counts_it() -> None:
    config = dataclasses.replace(TINY, capacity_factor=0.5)
    layer = _layer(config)
    x = torch.randn(2, 12, TINY.d_model, generator=torch.Generator().manual_seed(2))
    capacity = math.ceil(0.5 * 24 * TINY.top_k / TINY.n_experts)
    out = layer(x)
    with torch.no_grad():
        want = _by_token(layer, x.reshape(24, -1), capacity)
    assert torch.allclose(out.reshape(24, -1), want, atol=1e-6)
    out.sum().backward()
    (record,) = layer.take_records()
    assert int(record.dropped) == int((record.counts - capacity).clamp(min=0).sum()) > 0


def _objective_by_hand(config, batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
    """The training objective written out: per micro-batch, summed cross-entropy and each
    MoE layer's aux loss times its tokens, over the batch's tokens; its gradients."""
    model = build_full_model(model_spec(config), seed=0, device="cpu")
    inputs, targets = batch[:, :-1], batch[:, 1:]
    total = targets.numel()
    layers = [m for _, m in moe_layers(model)]
    for layer in layers:
        layer.aux_coef = 0.0  # the aux loss enters below, written out, instead
    auxes: list[torch.Tensor] = []
    # Capture each layer's aux loss as a differentiable value.
    hooks = [
        layer.register_forward_hook(lambda mod, args, out: auxes.append(_aux_of(mod, args[0])))
        for layer in layers
    ]
    objective = torch.zeros(())
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True):
        auxes.clear()
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        objective = objective + ce / total + config.aux_loss_coef * sum(auxes) * y.numel() / total
    for h in hooks:
        h.remove()
    objective.backward()
    return [p.grad.clone() for p in model.parameters()]


def _aux_of(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    tokens = x.reshape(-1, x.shape[-1])
    scores = layer.gate(tokens).float().softmax(-1)
    top = scores.topk(layer.top_k, dim=-1).indices
    fraction = torch.bincount(top.reshape(-1), minlength=layer.n_experts) / top.numel()
    return layer.n_experts * (fraction * scores.mean(0)).sum()


@pytest.mark.parametrize(
    ("schedule", "ranks", "recompute"), [("1f1b", 1, False), ("zb-h1", 2, True)]
)
def test_the_aux_loss_enters_backward_on_the_main_losss_scale(
    schedule: str, ranks: int, recompute: bool
) -> None:
    batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(3))
    want = _objective_by_hand(TINY, batch, 4)
    pipe = build_pipeline(
        model_spec(TINY), schedule=schedule, microbatches=4, ranks=ranks, device="cpu",
        split=block_split(TINY.n_layers, ranks),
    )  # fmt: skip
    for module in pipe.modules:
        apply_stage_options(
            module, device=torch.device("cpu"), precision="fp32", recompute=recompute,
            compile_stage=False,
        )  # fmt: skip
    pipe.step(batch[:, :-1], batch[:, 1:])
    got = [p.grad for p in pipe.parameters()]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-7)
    # Each micro-batch recorded once per layer, recomputed forward or not; weights add to 1.
    for module in pipe.modules:
        for _, layer in moe_layers(module):
            records = layer.take_records()
            assert len(records) == 4
            assert sum(r.weight for r in records) == pytest.approx(1.0)


def test_experts_do_not_depend_on_which_others_a_rank_holds() -> None:
    whole = build_full_model(model_spec(TINY), seed=5, device="cpu").state_dict()
    for rank in range(2):
        part = build_full_model(model_spec(TINY, expert_shard=(rank, 2)), seed=5, device="cpu")
        held = part.state_dict()
        experts = {k for k in held if ".experts." in k}
        assert {k.split(".experts.")[1].split(".")[0] for k in experts} == {
            str(2 * rank),
            str(2 * rank + 1),
        }
        for name, tensor in held.items():
            assert torch.equal(tensor, whole[name]), name


def test_the_loss_free_bias_moves_toward_balance() -> None:
    layer = _layer(dataclasses.replace(TINY, bias_update_rate=0.01))
    layer.update_bias(torch.tensor([10.0, 2.0, 4.0, 0.0]))
    # The mean load is 4: the busier experts go down, the idler up, the one at the mean stays.
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"top_k": 5}, "top_k=5 is more than n_experts=4"),
        ({"router": "relu"}, "router 'relu' is unknown"),
        ({"dense_first": 4}, "no block is a MoE block"),
        ({"capacity_factor": -1.0}, "capacity_factor must be finite and >= 0"),
    ],
)
def test_impossible_moe_configs_are_refused(fields: dict, says: str) -> None:
    with pytest.raises(ModelConfigError, match=says):
        dataclasses.replace(TINY, **fields)


def test_gpt2_has_no_experts() -> None:
    with pytest.raises(ModelConfigError, match="mixture-of-experts blocks are llama blocks"):
        get_model_config("gpt2-tiny", n_experts=4)
