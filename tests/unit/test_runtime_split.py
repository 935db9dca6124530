"""Splitting the backward into I and W: same gradients as B, and no work done twice."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipetrain.runtime.errors import StageMismatchError
from pipetrain.runtime.stage import StageRunner, install_split_backward
from pipetrain.schedules import Kind


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mlp(d: int, h: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.LayerNorm(h), nn.Linear(h, d, bias=False))


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def full_backward(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    model(leaf).backward(g)
    return leaf.grad


def split_backward(
    model: nn.Module, queue, x: torch.Tensor, g: torch.Tensor, mb: int = 0
) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    out = model(leaf)
    queue.begin(mb)
    out.backward(g)
    queue.end()
    return leaf.grad


def count_deferring_linears(monkeypatch) -> list[str]:
    """Record each linear forward that defers its weight products: "hook" or "function"."""
    from pipetrain.runtime import stage as stage_module

    calls: list[str] = []
    apply, hooked = stage_module._SplitLinear.apply, stage_module._hooked_linear

    def counted_function(*args):
        calls.append("function")
        return apply(*args)

    def counted_hook(*args):
        calls.append("hook")
        return hooked(*args)

    monkeypatch.setattr(stage_module._SplitLinear, "apply", counted_function)
    monkeypatch.setattr(stage_module, "_hooked_linear", counted_hook)
    return calls


def test_w_gives_the_gradient_of_b():
    model = mlp(32, 64)
    queue = install_split_backward(model)
    x, g = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    gx_b = full_backward(model, x, g)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    gx_i = split_backward(model, queue, x, g)
    torch.testing.assert_close(gx_i, gx_b, rtol=0, atol=0)
    # After I: the linear weights wait for W; the LayerNorm got its gradient from autograd.
    assert (
        model[0].weight.grad is None and model[0].bias.grad is None and model[3].weight.grad is None
    )
    assert model[2].weight.grad is not None
    queue.run(0)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-6, atol=1e-6)
        assert not grad.requires_grad


def test_w_accumulates_over_microbatches_like_b():
    model = mlp(16, 16)
    queue = install_split_backward(model)
    data = [(torch.randn(2, 3, 16), torch.randn(2, 3, 16)) for _ in range(3)]
    for x, g in data:
        full_backward(model, x, g)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    for mb, (x, g) in enumerate(data):
        split_backward(model, queue, x, g, mb)
    for mb in (2, 0, 1):  # W may run in any order after its I
        queue.run(mb)
    assert queue.pending == ()
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, ref[name], rtol=1e-6, atol=1e-6)


def test_i_plus_w_does_the_flops_of_b_and_not_much_more_time():
    d, h = 256, 1024
    model = mlp(d, h)
    queue = install_split_backward(model)
    x, g = torch.randn(8, 128, d), torch.randn(8, 128, d)

    def run_b() -> None:
        model.zero_grad(set_to_none=True)
        full_backward(model, x, g)

    def run_iw() -> None:
        model.zero_grad(set_to_none=True)
        split_backward(model, queue, x, g)
        queue.run(0)

    counts = []
    for fn in (run_b, run_iw):
        with FlopCounterMode(display=False) as counter:
            fn()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0

    def best(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    run_b(), run_iw()  # warm-up
    t_b, t_iw = best(run_b), best(run_iw)
    # Forward included in both; a W that redid the backward would cost about 1.7x.
    assert t_iw < 1.3 * t_b, (t_iw, t_b)


def test_runner_sends_input_grads_at_i_and_checks_gradient_shapes():
    model = mlp(8, 8)
    runner = StageRunner(
        1, model, is_first=False, is_last=False, loss_fn=lambda a, b: a.sum(), split_backward=True
    )
    x = torch.randn(2, 3, 8)
    (out,) = runner.forward(0, (x,), None, 1.0, True)
    with pytest.raises(StageMismatchError, match="stage 2 sent gradients"):
        runner.backward(0, (torch.ones(2, 4, 8),), weights=False)
    runner.forward(1, (x,), None, 1.0, True)
    (gx,) = runner.backward(1, (torch.ones_like(out),), weights=False)
    assert gx.shape == x.shape
    assert model[0].weight.grad is None
    runner.weight(1)
    assert model[0].weight.grad is not None


def test_w_gives_the_gradient_of_b_under_bf16_autocast():
    # Autocast runs each linear in bf16 on fp32 weights: I must hand back the input's
    # dtype and W must accumulate fp32 gradients, equal to what B accumulates.
    model = mlp(32, 64)
    queue = install_split_backward(model)
    x, g = torch.randn(4, 8, 32), torch.randn(4, 8, 32)

    def run(split: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(leaf)
        assert out.dtype == torch.bfloat16
        if split:
            queue.begin(0)
        out.backward(g.to(out.dtype))
        queue.end()
        if split:
            queue.run(0)
        assert leaf.grad is not None
        return leaf.grad

    gx_b = run(split=False)
    ref = grads(model)
    gx_iw = run(split=True)
    assert gx_iw.dtype == torch.float32
    torch.testing.assert_close(gx_iw, gx_b, rtol=0, atol=0)
    for name, grad in grads(model).items():
        assert grad.dtype == torch.float32, name
        torch.testing.assert_close(grad, ref[name], rtol=0, atol=0)


def test_early_input_gradients_route_only_their_microbatches_through_the_split_linear(
    monkeypatch,
):
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline

    spec = model_spec(get_model_config("llama-tiny"))
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    calls = count_deferring_linears(monkeypatch)
    runs = {}
    for early in (False, True):
        calls.clear()
        pipe = build_pipeline(spec, schedule="1f1b", microbatches=4, ranks=2, early_grads=early)
        result = pipe.step(x, y)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        runs[early] = (result.loss, grads, len(calls), pipe)
    (loss_b, grads_b, calls_b, _), (loss_iw, grads_iw, calls_iw, pipe) = runs[False], runs[True]
    assert [str(a) for a in pipe.schedule.actions[1] if a.kind in (Kind.I, Kind.W)] == [
        "1I3",
        "1W3",
    ]
    assert loss_iw == loss_b
    for name, grad in grads_b.items():
        torch.testing.assert_close(grads_iw[name], grad, rtol=1e-6, atol=1e-7)
    # Only micro-batch 3 of stage 1 ran its linears through a deferring path: the
    # others' forwards, and every forward without early gradients, ran natively.
    linears = sum(isinstance(m, nn.Linear) for m in pipe.modules[1].modules())
    assert calls_b == 0 and calls_iw == linears
    pipe.eval_loss(x, y)  # evaluation runs natively too
    assert len(calls) == linears


def test_evaluation_of_a_zero_bubble_pipeline_runs_natively(monkeypatch):
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline

    spec = model_spec(get_model_config("llama-tiny"))
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    pipe = build_pipeline(spec, schedule="zb-h1", microbatches=4, ranks=2)
    reference = build_pipeline(spec, schedule="1f1b", microbatches=4, ranks=2, early_grads=False)
    calls = count_deferring_linears(monkeypatch)
    loss = pipe.eval_loss(x, y)
    assert calls == []
    assert loss == reference.eval_loss(x, y)
    # Training afterwards still splits every backward (every linear of every micro-batch).
    pipe.step(x, y)
    linears = sum(isinstance(m, nn.Linear) for mod in pipe.modules for m in mod.modules())
    assert len(calls) == 4 * linears


def test_the_hook_defers_where_it_may_and_the_function_under_checkpointing(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    calls = count_deferring_linears(monkeypatch)
    model = mlp(32, 64)
    queue = install_split_backward(model)
    x, g = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    gx_b = full_backward(model, x, g)
    ref = grads(model)
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        calls.clear()
        leaf = x.detach().requires_grad_()
        out = checkpoint(model, leaf, use_reentrant=False) if recompute else model(leaf)
        queue.begin(0)
        out.backward(g)
        queue.end()
        assert model[0].weight.grad is None  # deferred either way
        queue.run(0)
        torch.testing.assert_close(leaf.grad, gx_b, rtol=0, atol=0)
        for name, grad in grads(model).items():
            torch.testing.assert_close(grad, ref[name], rtol=1e-6, atol=1e-6)
        # Checkpointing packs saved tensors by hooks: the function saves through them (and
        # runs again in the recomputation); without it, the hook.
        want = {"function"} if recompute else {"hook"}
        assert set(calls) == want and len(calls) >= 2


def test_an_input_changed_in_place_after_the_forward_is_an_error_not_a_wrong_w():
    model = nn.Linear(8, 8)
    queue = install_split_backward(model)
    leaf = torch.randn(2, 8, requires_grad=True)
    h = leaf * 1.0
    out = model(h)
    h.mul_(2.0)  # the linear's input, which its weight gradient needs
    queue.begin(0)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        out.sum().backward()
    queue.end()
