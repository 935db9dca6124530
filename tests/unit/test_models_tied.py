"""Tied input/output embedding split over two stages behaves like the single-process model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetrain.models import (
    StageModule,
    build_full_model,
    build_stage,
    get_model_config,
    model_spec,
)

KEY = "embed.tok.weight"


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (4, 12), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _pipelined_backward(
    first: StageModule, last: StageModule, ids: torch.Tensor, targets: torch.Tensor
) -> None:
    """Forward and backward through two stages as two ranks would, then sum the tied grads."""
    hidden = first(ids)
    received = hidden.detach().requires_grad_(True)
    _loss(last(received), targets).backward()
    hidden.backward(received.grad)
    a, b = first.tied_parameters()[KEY], last.tied_parameters()[KEY]
    assert a is not b
    total = a.grad + b.grad  # what the all-reduce (sum) between the two ranks computes
    a.grad.copy_(total)
    b.grad.copy_(total)


def test_a_stage_with_both_layers_shares_one_tensor() -> None:
    spec = model_spec(get_model_config("gpt2-tiny"))
    full = build_full_model(spec, seed=0, device="cpu")
    assert full.head.out.weight is full.embed.tok.weight
    assert list(full.tied_parameters()) == [KEY]
    assert (
        sum(
            1 for name, _ in full.named_parameters() if name.endswith("tok.weight") or "out" in name
        )
        == 1
    )


def test_untied_model_has_no_tied_parameters() -> None:
    spec = model_spec(get_model_config("llama-tiny"))
    assert build_stage(spec, [len(spec) - 1], seed=0, device="cpu").tied_parameters() == {}


@pytest.mark.parametrize(
    ("name", "optim"), [("gpt2-tiny", "sgd"), ("gpt2-tiny", "adamw"), ("llama-tiny", "adamw")]
)
def test_tied_copies_train_like_the_full_model(name: str, optim: str) -> None:
    config = get_model_config(name, tie_embeddings=True)
    spec = model_spec(config)
    n = len(spec)
    full = build_full_model(spec, seed=5, device="cpu")
    first = build_stage(spec, range(0, 2), seed=5, device="cpu")
    last = build_stage(spec, range(2, n), seed=5, device="cpu")
    assert torch.equal(first.tied_parameters()[KEY], last.tied_parameters()[KEY])
    assert "head.out.weight" in last.state_dict()

    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if optim == "sgd":
            return torch.optim.SGD(params, lr=0.5)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    ref_opt = make(list(full.parameters()))
    opts = [make(list(first.parameters())), make(list(last.parameters()))]
    for step in range(4):
        ids, targets = _batch(step)
        ref_opt.zero_grad()
        _loss(full(ids), targets).backward()
        for opt in opts:
            opt.zero_grad()
        _pipelined_backward(first, last, ids, targets)
        reference_grad = full.embed.tok.weight.grad
        torch.testing.assert_close(
            first.tied_parameters()[KEY].grad, reference_grad, rtol=1e-5, atol=1e-7
        )
        ref_opt.step()
        for opt in opts:
            opt.step()
        a, b = first.tied_parameters()[KEY], last.tied_parameters()[KEY]
        assert torch.equal(a, b), f"tied copies drifted apart at step {step}"
        # AdamW magnifies rounding differences in the gradient sum (see torch-on-cpu.md).
        tol = 1e-6 if optim == "sgd" else 1e-4
        torch.testing.assert_close(a, full.embed.tok.weight, rtol=tol, atol=tol)
    staged = {**first.state_dict(), **last.state_dict()}
    for key, tensor in full.state_dict().items():
        torch.testing.assert_close(staged[key], tensor, rtol=1e-4, atol=1e-4)
