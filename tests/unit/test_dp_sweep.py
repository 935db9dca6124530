"""Data-parallel sweep: the errors of ``--shard``'s reduce-scatter name the step as the
progress does (from 1), not the loop's index from 0."""

from __future__ import annotations

from typing import Any

import pytest

from pipetrain.runtime import PipelineError
from pipetrain.train import sharded
from pipetrain.train.parallel import Mesh


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
