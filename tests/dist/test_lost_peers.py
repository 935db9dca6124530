"""A rank that dies: what its surviving peer reports, and how soon.

One launch of three processes: global ranks 1 and 2 run an evaluation pass and a
training step of a tiny pipeline on their own group, then rank 2 is killed (SIGKILL).
Rank 1 meets the dead peer in the pipeline's barrier at the start of its next step, then
(the barrier switched off) in the step's first transfer; ranks 0 and 1 meet it in a
collective of the trainer outside the pipeline (the peak-memory gather of the summary).
Each writes what its failures said and how long they took.
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
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.launch.process_exit import exit_rank
    from pipetrain.runtime import build_pipeline
    from pipetrain.runtime.errors import PipelineError, lost_peer_error
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.shared import peak_memory_per_rank

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={TIMEOUT_S}))
    rank = dist.get_rank()
    # The pipeline runs on global ranks 1 and 2 (its ranks 0 and 1), as one replica of a
    # data-parallel run would; global rank 0 only takes part in the world's gather.
    group = dist.new_group([1, 2])
    if rank > 0:
        spec = model_spec(get_model_config("llama-tiny"))
        pipe = build_pipeline(
            spec, schedule="1f1b", microbatches=2, group=group,
            device=torch.device("cpu"), seed=0, timeout_s={TIMEOUT_S},
        )
        ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
        # An evaluation pass and a training step go through; the second training step
        # meets the dead peer in its barrier.
        pipe.eval_loss(ids[:, :-1], ids[:, 1:])
        pipe.step(ids[:, :-1], ids[:, 1:])
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            pipe.step(ids[:, :-1], ids[:, 1:])
        except PipelineError as exc:
            print(f"barrier after {{time.monotonic() - start:.1f}} s: {{exc}}", file=sys.stderr)
        # Past the barrier, the step's first transfer meets the closed connection.
        import pipetrain.runtime.api as api
        api.dist_barrier = lambda *args, **kwargs: None
        start = time.monotonic()
        try:
            # A loop that resumed or accumulates names its steps itself.
            pipe.step(ids[:, :-1], ids[:, 1:], label="training step 41 (accumulation 2 of 2)")
        except PipelineError as exc:
            print(f"transfer after {{time.monotonic() - start:.1f}} s: {{exc}}", file=sys.stderr)
    start = time.monotonic()
    try:
        peak_memory_per_rank(ProcessRole(rank=rank, world_size=3), torch.device("cpu"))
    except Exception as exc:
        failure = lost_peer_error(exc, rank=rank, timeout_s={TIMEOUT_S})
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
    run = launch(3, [], timeout_s=150.0, worker=script)
    assert run.returncodes == (0, 0, -signal.SIGKILL), (run.returncodes, run.stderr[1][-3000:])
    for rank in (0, 1):
        assert "Traceback" not in run.stderr[rank], run.stderr[rank][-3000:]

    # gloo's monitored barrier says "failed to pass in 60000 ms" for a closed connection
    # too; the peer died, it was not late. The step is the second training step, as the
    # user counts (the pipeline's third pass, after the evaluation), and the pipeline's
    # ranks are told apart from the global ones.
    seconds, text = _line(run.stderr[1], "barrier")
    assert seconds < TIMEOUT_S / 2
    assert text.startswith(
        "rank 0: training step 2, barrier at the start of the step: peer rank(s) 1 were lost "
    ), text
    assert "did not arrive" not in text, text
    assert text.endswith(
        " [ranks of this pipeline's group: 0 is global rank 1, 1 is global rank 2]"
    ), text

    # Past the barrier (switched off), the step's first transfer: gloo refuses to post it
    # on the closed connection with its own RuntimeError, which becomes the same line,
    # here with the step as the caller labelled it.
    seconds, text = _line(run.stderr[1], "transfer")
    assert seconds < TIMEOUT_S / 2
    assert text.startswith("rank 0: training step 41 (accumulation 2 of 2), "), text
    assert "was lost" in text, text
    assert text.endswith(
        " [ranks of this pipeline's group: 0 is global rank 1, 1 is global rank 2]"
    )

    # A collective outside the pipeline: one line naming the rank, where it waited and
    # what happened, not gloo's multi-line RuntimeError.
    for rank in (0, 1):
        seconds, text = _line(run.stderr[rank], "gather")
        assert seconds < TIMEOUT_S / 2
        assert re.fullmatch(
            rf"rank {rank}: waiting on other ranks in peak_memory_per_rank "
            r"\(pipetrain/train/shared\.py:\d+\): a peer was lost \(.*\)",
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
