"""A user's own model over gloo: each rank loads its own layers from a full state dict
and takes the side inputs its layers ask for; the loss is one process's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F
from runtime_launch import launch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_user_model import V, batch, user_spec  # noqa: E402

from pipetrain.models import build_full_model  # noqa: E402

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("user_model_worker.py")


def test_each_rank_loads_its_layers_and_takes_its_side_inputs(tmp_path: Path) -> None:
    result = launch(2, [str(tmp_path)], timeout_s=180.0, worker=WORKER)
    assert result.returncodes == (0, 0), result.stderr
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    inputs, targets, positions = batch()
    full = build_full_model(user_spec(), seed=2, device="cpu")
    logits = full(inputs, positions=positions)
    want = float(F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).detach())
    for report in reports:
        assert report["loss"] == pytest.approx(want, rel=1e-6)
    names = [set(report["names"]) for report in reports]
    assert not names[0] & names[1]  # each rank holds only its own layers
    assert names[0] | names[1] == set(full.state_dict())
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
