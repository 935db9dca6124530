"""``Pipeline.reschedule``: the same stages run by a schedule of another micro-batch count
(``pipetrain train --microbatches auto``) give the gradients of one process."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import PipelineInputError, build_pipeline
from pipetrain.runtime.build import resolve_schedule
from pipetrain.runtime.stage import token_cross_entropy

RTOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def spec():
    return model_spec(get_model_config("llama-tiny", n_layers=6, tie_embeddings=True))


def batch(seed: int, b: int = 8, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100
    return ids[:, :-1], targets


def check_step(pipe, full, seed: int) -> None:
    """One pipeline step against one process, gradients included; both zeroed after."""
    x, y = batch(seed)
    ref = token_cross_entropy(full(x), y) / (y != -100).sum()
    ref.backward()
    assert pipe.step(x, y).loss == pytest.approx(ref.item(), rel=RTOL)
    grads = {n: p.grad for n, p in full.named_parameters()}
    for module in pipe.modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            want = grads[pipe.tied_names.get(name, name)]
            assert float((p.grad - want).norm() / want.norm()) < RTOL, name
    pipe.zero_grad()
    full.zero_grad()


@pytest.mark.parametrize(
    ("name", "counts", "early"),
    [("1f1b", (4, 2, 8, 4), True), ("interleaved-1f1b", (4, 2, 8), True), ("1f1b", (4, 8), False)],
)
def test_each_count_trains_like_one_process(spec, name, counts, early) -> None:
    # early=False: built without split backwards, the stages split them when the new
    # program (prepared with early input gradients) asks for it.
    pipe = build_pipeline(
        spec, schedule=name, ranks=2, microbatches=counts[0], seed=0, device="cpu",
        early_grads=early,
    )  # fmt: skip
    full = build_full_model(spec, seed=0, device="cpu")
    x, y = batch(99)
    eval_before = pipe.eval_loss(x, y)
    for seed, m in enumerate(counts):
        if seed:
            pipe.reschedule(resolve_schedule(name, 2, m, None))
            assert pipe.schedule.microbatches == m
        check_step(pipe, full, seed)
    # Evaluation keeps the program the pipeline was built with, and the same numbers.
    assert pipe.eval_loss(x, y) == pytest.approx(eval_before, rel=RTOL)


def test_another_placement_is_refused(spec) -> None:
    pipe = build_pipeline(spec, schedule="1f1b", ranks=2, microbatches=4, seed=0, device="cpu")
    with pytest.raises(PipelineInputError, match="same placement"):
        pipe.reschedule(resolve_schedule("interleaved-1f1b", 2, 4, None))
