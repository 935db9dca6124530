"""A rank that dies: what its surviving peer reports, and how soon.

One launch of two processes: both run an evaluation pass and a training step of a tiny
pipeline, then rank 1 is killed (SIGKILL); rank 0 meets the dead peer twice, in the
pipeline's barrier at the start of its next step and in a collective of the trainer
outside the pipeline (the peak-memory gather of the summary), and writes what each
failure said and how long it took.
"""

from __future__ import annotations

import re
import signal
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist
from runtime_launch import launch

from pipetrain.runtime.errors import PipelineError, lost_peer_error

pytestmark = pytest.mark.dist

# Long enough that a failure which waited for it cannot pass for one that did not.
TIMEOUT_S = 60.0

SCRIPT = textwrap.dedent(
    f"""
    import datetime, os, signal, sys, time
    import torch
    import torch.distributed as dist
    from pipetrain.process_exit import exit_rank
    from pipetrain.runtime.errors import PipelineError, lost_peer_error
    from pipetrain.train.loop import ProcessRole, peak_memory_per_rank

    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={TIMEOUT_S}))
    rank = dist.get_rank()
    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(
        spec, schedule="1f1b", microbatches=2, group=dist.group.WORLD,
        device=torch.device("cpu"), seed=0, timeout_s={TIMEOUT_S},
    )
    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    # An evaluation pass and a training step go through; the second training step meets
    # the dead peer in its barrier.
    pipe.eval_loss(ids[:, :-1], ids[:, 1:])
    pipe.step(ids[:, :-1], ids[:, 1:])
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        pipe.step(ids[:, :-1], ids[:, 1:])
    except PipelineError as exc:
        print(f"barrier after {{time.monotonic() - start:.1f}} s: {{exc}}", file=sys.stderr)
    start = time.monotonic()
    try:
        peak_memory_per_rank(ProcessRole(rank=0, world_size=2), torch.device("cpu"))
    except Exception as exc:
        failure = lost_peer_error(exc, rank=0, timeout_s={TIMEOUT_S})
        print(f"gather after {{time.monotonic() - start:.1f}} s: {{failure}}", file=sys.stderr)
    exit_rank(0)
    """
)


def _line(stderr: str, prefix: str) -> tuple[float, str]:
    match = re.search(rf"^{prefix} after ([\d.]+) s: (.*)$", stderr, re.MULTILINE)
    assert match, stderr[-3000:]
    return float(match.group(1)), match.group(2)


def test_a_dead_peer_is_reported_as_lost_at_once_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "lost_peer.py"
    script.write_text(SCRIPT)
    run = launch(2, [], timeout_s=150.0, worker=script)
    assert run.returncodes == (0, -signal.SIGKILL), (run.returncodes, run.stderr[0][-3000:])
    err = run.stderr[0]
    assert "Traceback" not in err, err[-3000:]

    # gloo's monitored barrier says "failed to pass in 60000 ms" for a closed connection
    # too; the peer died, it was not late. The step is the second training step, as the
    # user counts (the pipeline's third pass, after the evaluation).
    seconds, text = _line(err, "barrier")
    assert seconds < TIMEOUT_S / 2
    assert text.startswith(
        "rank 0: training step 2, barrier at the start of the step: peer rank(s) 1 "
    ), text
    assert "were lost" in text and "did not arrive" not in text, text

    # A collective outside the pipeline: one line naming the rank, where it waited and
    # what happened, not gloo's multi-line RuntimeError.
    seconds, text = _line(err, "gather")
    assert seconds < TIMEOUT_S / 2
    assert re.fullmatch(
        r"rank 0: waiting on other ranks in peak_memory_per_rank \(pipetrain/train/loop\.py:\d+\): "
        r"a peer was lost \(.*\)",
        text,
    ), text


def test_lost_peer_error_keeps_other_errors_for_their_traceback() -> None:
    # Not a communication failure: None, so the caller re-raises it with its traceback.
    assert lost_peer_error(ValueError("bad value"), rank=0, timeout_s=5) is None
    assert lost_peer_error(RuntimeError("shape mismatch"), rank=0, timeout_s=5) is None
    own = PipelineError("rank 1: step 3, ...")
    assert lost_peer_error(own, rank=1, timeout_s=5) is own
    # torch's store when a rank never joins the process group (SIGSTOPped at start-up).
    store = dist.DistStoreError("wait timeout after 20000ms, keys: /default_pg/0//cpu//0/1")
    failure = lost_peer_error(store, rank=0, timeout_s=20)
    assert failure is not None
    assert str(failure) == (
        "rank 0: waiting on other ranks in a torch.distributed call: a peer did not answer "
        "within 20 s (it is stopped, hung or was never started; raise pipeline.timeout_s if "
        "it is just slow)"
    )
