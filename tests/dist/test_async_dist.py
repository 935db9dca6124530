"""Asynchronous pipelines across processes (gloo) against the single-process reference.

One launch of 4 processes runs every case (``async_worker.py``): PipeDream, PipeDream
with vertical sync and PipeDream-2BW on 4 ranks, and two 2-rank pipelines side by side.
The reference runs here, once per case, and every rank's stage is compared with it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from async_worker import STREAM_STEPS, STREAMS, WINDOW, batches, sgd
from runtime_launch import launch

from pipetrain.models import get_model_config, model_spec
from pipetrain.runtime import even_split
from pipetrain.train.pipedream.reference import ReferenceResult, reference_run

pytestmark = pytest.mark.dist

RTOL = 1e-5
WORKER = Path(__file__).with_name("async_worker.py")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("async")
    result = launch(4, [str(out)], worker=WORKER)
    assert result.returncodes == (0,) * 4, "\n".join(result.stderr)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@cache
def reference(schedule: str, pp: int, vertical: bool) -> ReferenceResult:
    spec = model_spec(get_model_config("llama-tiny", n_layers=4))
    return reference_run(
        spec,
        even_split(len(spec), pp),
        schedule=schedule,
        pp=pp,
        microbatches=WINDOW,
        stream_steps=STREAM_STEPS,
        streams=STREAMS,
        batches=batches(),
        make_optimizer=sgd,
        vertical_sync=vertical,
    )


CASES = [
    ("pipedream/4", "pipedream", False, range(4), [4, 3, 2, 1]),
    ("pipedream-vsync/4", "pipedream", True, range(4), None),
    ("pipedream-2bw/4", "pipedream-2bw", False, range(4), [2, 2, 2, 2]),
    ("pipedream/2", "pipedream", False, range(2), [2, 1]),
    ("pipedream-2bw/2", "pipedream-2bw", False, range(2, 4), [2, 2]),
]


@pytest.mark.parametrize(
    ("case", "schedule", "vertical", "ranks", "peaks"), CASES, ids=[c[0] for c in CASES]
)
def test_equals_reference_and_counts_versions(  # type: ignore[no-untyped-def]
    reports, case, schedule, vertical, ranks, peaks
) -> None:
    ref = reference(schedule, len(ranks), vertical)
    names: set[str] = set()
    for rank in ranks:
        res = reports[rank][case]
        torch.testing.assert_close(
            torch.tensor(res["losses"]), torch.tensor(ref.losses), rtol=RTOL, atol=0
        )
        for name, weight in res["weights"].items():
            torch.testing.assert_close(weight, ref.weights[name], rtol=RTOL, atol=1e-7)
        names |= set(res["weights"])
        # Between streams a stage holds one version: its parameters.
        assert res["live_after"] == [1]
        if peaks is not None:
            assert res["peaks"] == peaks, (rank, res["peaks"])
        else:
            # Vertical sync: stage 0 holds p versions, later stages at least p - r.
            assert res["peaks"][0] == 4 and all(v >= 4 - r for r, v in enumerate(res["peaks"]))
    # Together the ranks hold every weight of the model, each compared above.
    assert names == set(ref.weights)
