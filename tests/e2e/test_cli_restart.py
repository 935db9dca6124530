"""Restarts under torchrun with --resume: a group restarted after a rank died goes on from
the newest checkpoint and ends with the losses of a run that was never interrupted; an
elastic restart on fewer processes (``--nnodes 1:2``, one "node" of two lost) re-plans the
pipeline for them (``pipetrain.config.elastic``) and goes on as a run of that many
processes resumed from the same checkpoint.

The fault: a ``sitecustomize`` module on PYTHONPATH (imported by every process at
start-up) makes a rank SIGKILL itself in the first attempt only (TORCHELASTIC_RESTART_COUNT
0): in the middle of step N, as it starts the forward of micro-batch 2, when the
environment variable PIPETRAIN_TEST_DIE_IN_STEP is N; after its optimizer step N when
PIPETRAIN_TEST_DIE_AT_STEP is; with PIPETRAIN_TEST_KILL_NODE it kills its torchrun agent
first, so that its whole "node" is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from local_port import reserved_port
from run_records import losses, read_records, train_run

pytestmark = pytest.mark.e2e

FAULT = textwrap.dedent(
    """
    import os
    die_at = os.environ.get("PIPETRAIN_TEST_DIE_AT_STEP")
    die_in = os.environ.get("PIPETRAIN_TEST_DIE_IN_STEP")
    mine = os.environ.get("RANK") == os.environ.get("PIPETRAIN_TEST_RANK", os.environ.get("RANK"))
    if (die_at or die_in) and mine and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        import signal
        import sys
        from pipetrain.checkpoint.trainer import RunCheckpoints
        from pipetrain.runtime.executor import RankExecutor

        after_step, forward = RunCheckpoints.after_step, RankExecutor._forward
        finished = [0]  # the optimizer steps done

        def die(where):
            sys.stderr.write(f"test fault: rank {os.environ['RANK']} killed {where}\\n")
            sys.stderr.flush()
            if os.environ.get("PIPETRAIN_TEST_KILL_NODE"):
                os.kill(os.getppid(), signal.SIGKILL)  # this node's torchrun agent
            os.kill(os.getpid(), signal.SIGKILL)

        def counting(self, step):
            finished[0] = step
            if die_at and step == int(die_at):
                die(f"after step {step}")
            return after_step(self, step)

        def dying(self, action):
            if die_in and finished[0] == int(die_in) - 1 and action.microbatch == 2:
                die(f"in step {die_in} at {action}")
            return forward(self, action)

        RunCheckpoints.after_step = counting
        RankExecutor._forward = dying
    """
)

FLAGS = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "4", "--seq-len", "16",
    "--batch-size", "8", "--eval-every", "0", "--checkpoint-every", "2",
    "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
    "--set", "pipeline.threads=1", "--set", "pipeline.timeout_s=60",
]  # fmt: skip


def _torchrun(
    tmp_path: Path, torchrun: list[str], flags: list[str], env: dict[str, str]
) -> subprocess.Popen[str]:
    """``torchrun TORCHRUN -m pipetrain.cli train FLAGS`` with the fault module importable."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(FAULT)
    command = [
        sys.executable, "-m", "torch.distributed.run", *torchrun,
        "-m", "pipetrain.cli", "train", *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path / "site"), **env}
    pipe = subprocess.PIPE
    return subprocess.Popen(
        command, stdout=pipe, stderr=pipe, text=True, env=env, start_new_session=True
    )


def _why(err: str) -> str:
    """pipetrain's lines of a failed launch's stderr, then its end (torchrun's summary)."""
    ours = [line for line in err.splitlines() if line.startswith("pipetrain")]
    return "\n".join([*ours, err[-2000:]])


def _finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def _flags(work: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [*FLAGS, "--data", str(work / "data"), "--checkpoint-dir", str(checkpoints), *extra]


def _named(work: Path, name: str) -> list[str]:
    """What ``train_run`` adds: the run's name and folder."""
    return ["--name", name, "--set", f"run.out_dir={json.dumps(str(work / 'runs'))}"]


def _listening(port: int, timeout: float = 120) -> None:
    """Wait until something listens on ``port`` of 127.0.0.1 (a torchrun agent's store)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.2)


def test_a_group_restarted_after_a_rank_died_ends_with_the_uninterrupted_losses(
    work: Path, tmp_path: Path
) -> None:
    flags = _flags(work, tmp_path / "ckpt", "--microbatches", "4")
    with reserved_port() as port:
        torchrun = [
            "--nproc-per-node", "2", "--max-restarts", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
        ]  # fmt: skip
        env = {"PIPETRAIN_TEST_DIE_IN_STEP": "3", "PIPETRAIN_TEST_RANK": "1"}
        run = [*flags, *_named(work, "restarted"), "--resume"]
        code, out, err = _finish(_torchrun(tmp_path, torchrun, run, env))
    assert code == 0, _why(err)
    # Rank 1 died in the middle of step 3 (1F1B: after two backwards of it, before the
    # other two), so no rank finished step 3 in the first attempt: nothing to set aside.
    assert "test fault: rank 1 killed in step 3 at 1F2" in err.splitlines(), _why(err)
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000002'} at step 2" in out
    assert not list((work / "runs" / "restarted").glob("metrics.superseded-*.jsonl"))

    # The same run, never interrupted, through pipetrain's own launcher.
    train_run(work / "runs", "whole", *_flags(work, tmp_path / "whole", "--microbatches", "4"))
    expected = losses(work / "runs" / "whole")
    assert sorted(expected) == [1, 2, 3, 4]
    assert losses(work / "runs" / "restarted") == expected  # bit for bit


def test_an_elastic_restart_on_fewer_processes_re_plans_and_goes_on(
    work: Path, tmp_path: Path
) -> None:
    """Two torchrun "nodes" of 2 processes train pp 2 x dp 2; node 1 dies after step 3.
    The node left restarts alone (--nnodes 1:2) as pp 2 x dp 1, with twice the
    micro-batches of the same rows, from the checkpoint of step 2."""
    flags = _flags(work, tmp_path / "ckpt", "--dp", "2", "--microbatches", "2", "--resume")
    flags += _named(work, "elastic")
    with reserved_port() as port:
        torchrun = [
            "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "elastic", "--rdzv-conf", "last_call_timeout=10",
        ]  # fmt: skip
        stays = _torchrun(tmp_path, torchrun, flags, {})
        # The node that stays hosts the rendezvous (the first agent up does): the one
        # left must still reach it to restart.
        _listening(port)
        dies = _torchrun(
            tmp_path,
            torchrun,
            flags,
            {"PIPETRAIN_TEST_DIE_AT_STEP": "3", "PIPETRAIN_TEST_KILL_NODE": "1"},
        )
        code, out, err = _finish(stays)
        _finish(dies, timeout=30)
    assert code == 0, _why(err)
    note = (
        "elastic: 2 processes continue this run of pp 2 x dp 2 (4 processes): re-planned as "
        "pp 2 x dp 1, 4 micro-batches of 2 rows per replica (was 2 of 2), the same global "
        "batch of 8 rows; the checkpoint is resharded as it loads"
    )
    assert note in out.splitlines(), out[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / 'step_000002'} at step 2" in out
    got = losses(work / "runs" / "elastic")

    # A 2-process run of the re-planned pipeline, resumed from the same checkpoint.
    (tmp_path / "copy").mkdir()
    shutil.copytree(tmp_path / "ckpt" / "step_000002", tmp_path / "copy" / "step_000002")
    train_run(
        work / "runs", "two", *_flags(work, tmp_path / "copy", "--microbatches", "4", "--resume")
    )
    expected = losses(work / "runs" / "two")
    assert sorted(expected) == [3, 4]
    assert {step: got[step] for step in (3, 4)} == expected  # bit for bit
    # Step 3 as the 4 processes trained it before node 1 died (set aside on resume): the
    # same rows, summed in another order.
    (aside,) = (work / "runs" / "elastic").glob("metrics.superseded-*.jsonl")
    before = {r["step"]: r["loss"] for r in read_records(aside) if "loss" in r}
    assert before[3] == pytest.approx(got[3], rel=1e-5)
