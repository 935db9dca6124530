"""Data-parallel and numeric-option sweep: the errors of ``--shard``'s reduce-scatter name
the step as the progress does (from 1), and a diverging run's advice names what to change."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pipetrain.config.schema import OptimConfig
from pipetrain.parallel import sharded
from pipetrain.parallel.mesh import Mesh
from pipetrain.runtime import PipelineError
from pipetrain.train.optim import Gradients, GuardedUpdate, TrainingDiverged, build_optimizer


def _failing(module: Any) -> None:
    raise RuntimeError("Connection closed by peer\nmore detail")


def _gradients(monkeypatch: pytest.MonkeyPatch) -> sharded.ShardedGradients:
    # No process group: the mesh only has to name this rank, the reduction is faked.
    mesh = Mesh(2, 2, 1, 0, None, None, None, dp_mesh=object())
    grads = sharded.ShardedGradients(mesh, timeout_s=1.0)
    grads._modules = {0: object()}  # type: ignore[dict-item]
    grads._order = [0]
    monkeypatch.setattr(sharded, "_reduce_scatter_now", _failing)
    return grads


def test_reduce_scatter_failure_names_the_step_from_1(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _gradients(monkeypatch)
    # The loop's step 4 (from 0) is what the progress shows as step 5.
    with pytest.raises(PipelineError) as failed:
        grads.finish(4)
    message = str(failed.value)
    assert message.startswith("rank 2: training step 5, reduce-scatter of stage 0's"), message
    assert message.endswith("failed or timed out: Connection closed by peer"), message


def test_reduce_scatter_failure_inside_a_step_names_that_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grads = _gradients(monkeypatch)
    monkeypatch.setattr(sharded, "_reduce_scatter_now", lambda module: None)
    grads.finish(6)  # a resumed run: its first finished step was the loop's 6
    monkeypatch.setattr(sharded, "_reduce_scatter_now", _failing)
    grads._sync = True
    with pytest.raises(PipelineError, match=r"^rank 2: training step 8, reduce-scatter"):
        grads.grads_hook(0)  # inside the next pipeline step, the progress's step 8


def test_reduce_scatter_failure_before_any_finished_step(monkeypatch: pytest.MonkeyPatch) -> None:
    grads = _gradients(monkeypatch)
    grads._sync = True
    with pytest.raises(PipelineError, match=r"^rank 2: its first training step, reduce-scatter"):
        grads.grads_hook(0)


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
