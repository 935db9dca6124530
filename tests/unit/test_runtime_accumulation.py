"""Gradients accumulated over several steps (``step`` again before ``zero_grad``) where
copies of a weight are summed at the end of each step: tied embeddings on two ranks and
Chimera's replicated stages. Every copy must hold what one process accumulates."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models import PipelineSpec, build_full_model, get_model_config, model_spec
from pipetrain.runtime import build_pipeline
from pipetrain.runtime.stage import token_cross_entropy

STEPS = 3


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (4, 13), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _reference(spec: PipelineSpec) -> dict[str, torch.Tensor]:
    """One process: the summed loss of each step divided by its tokens, accumulated."""
    full = build_full_model(spec, seed=0, device="cpu")
    for ids, targets in _batches():
        (token_cross_entropy(full(ids), targets) / targets.numel()).backward()
    return {name: p.grad.clone() for name, p in full.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model", "schedule", "ranks"),
    [
        ("gpt2-tiny", "1f1b", 2),  # the tied embedding on the first and the last rank
        ("gpt2-tiny", "zb-v", 2),  # both ends on rank 0: two copies in one process
        ("llama-tiny", "chimera", 2),  # every stage on two ranks
    ],
)
def test_accumulated_steps_equal_one_process(model: str, schedule: str, ranks: int) -> None:
    spec = model_spec(get_model_config(model))
    pipe = build_pipeline(
        spec, schedule=schedule, microbatches=2 * ranks, ranks=ranks, device="cpu", seed=0
    )
    for ids, targets in _batches():
        pipe.step(ids, targets)
    want = _reference(spec)
    compared = 0
    for module in pipe.modules:
        for name, p in module.named_parameters(remove_duplicate=False):
            key = pipe.tied_names.get(name, name)
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, want[key], rtol=1e-5, atol=1e-7, msg=name)
            compared += 1
    assert compared > len(want)  # copies were compared, not only distinct weights
