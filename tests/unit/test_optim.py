"""Optimizer: decay groups, the learning-rate schedule, clipping, the NaN guard, and a
diverging run's advice, which names what to change."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipetrain.config.schema import OptimConfig
from pipetrain.train.optim import (
    Gradients,
    GuardedUpdate,
    TrainingDiverged,
    build_optimizer,
    check_gradients,
    lr_at,
    param_groups,
)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(self.embed(x)))
        return out


def _with_grads(seed: int = 0) -> _Tiny:
    torch.manual_seed(seed)
    model = _Tiny()
    model(torch.arange(8) % 11).pow(2).sum().mul(30.0).backward()
    return model


def test_no_decay_on_norms_biases_and_vectors() -> None:
    model = _Tiny()
    decay, keep = param_groups(model.named_parameters(), 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay["params"]) == ["embed.weight", "proj.weight"]  # type: ignore[attr-defined]
    assert sorted(names[id(p)] for p in keep["params"]) == ["norm.bias", "norm.weight", "proj.bias"]  # type: ignore[attr-defined]
    assert (decay["weight_decay"], keep["weight_decay"]) == (0.1, 0.0)


def test_lr_warms_up_linearly_then_decays_by_cosine() -> None:
    config = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, config, 15) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, config, 15) == pytest.approx(1.0)
    assert lr_at(9, config, 15) == pytest.approx(0.55)  # halfway: the mean of 1.0 and 0.1
    assert lr_at(14, config, 15) == pytest.approx(0.1)  # the last step reaches the floor
    decay = [lr_at(s, config, 15) for s in range(4, 15)]
    assert decay == sorted(decay, reverse=True)
    assert lr_at(0, OptimConfig(lr=1.0, warmup_steps=0), 5) == 1.0


def test_norm_and_clip_match_torch() -> None:
    ours, ref = _with_grads(), _with_grads()
    check = check_gradients(Gradients.of(list(ours.parameters())), 1.0, None)
    expected = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert check.norm == pytest.approx(float(expected), rel=1e-6)
    assert check.norm > 0.5  # so that the step below clips
    update = GuardedUpdate(
        torch.optim.SGD(ours.parameters(), lr=1.0),
        OptimConfig(lr=1.0, grad_clip=0.5, warmup_steps=0),
        total_steps=1,
        group=None,
    )
    grads_before = [p.grad.clone() for p in ours.parameters()]  # type: ignore[union-attr]
    before = [p.detach().clone() for p in ours.parameters()]
    outcome = update.apply(0, Gradients.of(list(ours.parameters())), 1.0)
    assert outcome.clip_factor == pytest.approx(0.5 / check.norm, rel=1e-5)
    for old, p, g, r in zip(before, ours.parameters(), grads_before, ref.parameters(), strict=True):
        # SGD with lr 1: the step is exactly the clipped gradient, as torch clipped it.
        assert r.grad is not None
        torch.testing.assert_close(p.detach(), old - r.grad)
        torch.testing.assert_close(r.grad, g * outcome.clip_factor)


def test_tied_copy_is_counted_once_but_stepped() -> None:
    a = nn.Parameter(torch.zeros(3))
    b = nn.Parameter(torch.zeros(3))
    a.grad = torch.tensor([3.0, 0.0, 0.0])
    b.grad = torch.tensor([3.0, 0.0, 0.0])
    grads = Gradients.of([a, b], not_counted=[b])
    assert check_gradients(grads, 0.0, None).norm == pytest.approx(3.0)
    b.grad[1] = math.nan
    assert not check_gradients(grads, 0.0, None).finite


def test_accumulated_gradients_are_averaged() -> None:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([6.0, 8.0])  # two pipeline steps' gradients, summed
    update = GuardedUpdate(
        torch.optim.SGD([p], lr=1.0),
        OptimConfig(lr=1.0, grad_clip=0.0, warmup_steps=0),
        total_steps=1,
        group=None,
    )
    outcome = update.apply(0, Gradients.of([p]), 1.0, accumulated=2)
    assert outcome.grad_norm == pytest.approx(5.0)
    torch.testing.assert_close(p.detach(), torch.tensor([-3.0, -4.0]))


def test_nan_loss_or_gradient_skips_and_k_in_a_row_stop() -> None:
    model = _with_grads()
    optimizer = build_optimizer(model.named_parameters(), OptimConfig())
    update = GuardedUpdate(
        optimizer, OptimConfig(max_bad_steps=3, warmup_steps=0), total_steps=10, group=None
    )
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())

    outcome = update.apply(0, Gradients.of(params), math.nan)
    assert outcome.skipped and outcome.bad_in_row == 1 and math.isnan(outcome.grad_norm)
    assert all(p.grad is None for p in params)  # the bad gradients are dropped

    model.proj.weight.grad = torch.full_like(model.proj.weight, math.inf)
    assert update.apply(1, Gradients.of(params), 1.0).bad_in_row == 2
    for old, p in zip(before, params, strict=True):
        assert torch.equal(old, p.detach())  # no update with bad gradients

    # A good step resets the count.
    model(torch.arange(4)).sum().backward()
    good = update.apply(2, Gradients.of(params), 1.0)
    assert not good.skipped and good.bad_in_row == 0 and math.isfinite(good.grad_norm)

    update.apply(3, Gradients.of(params), math.inf)
    update.apply(4, Gradients.of(params), math.nan)
    with pytest.raises(
        TrainingDiverged,
        match=r"step 6: .*3 steps in a row \(optim.max_bad_steps = 3\): lower --lr",
    ):
        update.apply(5, Gradients.of(params), math.nan)


def test_divergence_names_the_fields_to_change_without_sending_fp32_to_fp32() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    config = OptimConfig(max_bad_steps=1)
    update = GuardedUpdate(
        build_optimizer([("w", param)], config), config, total_steps=5, group=None
    )
    param.grad = torch.tensor([1.0, math.nan, 0.0])
    with pytest.raises(TrainingDiverged) as diverged:
        update.apply(0, Gradients.of([param]), 2.0)
    message = str(diverged.value)
    # The advice fits an fp32 run too (the only one told to "use --precision fp32" before).
    assert message.endswith(
        "lower --lr or raise optim.warmup_steps (under --precision bf16, also try fp32)"
    ), message
