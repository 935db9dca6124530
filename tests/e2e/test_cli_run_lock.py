"""Two runs on one folder at once (``pipetrain.config.lock``): while a 2-process run trains,
a second run with its --name, and a --resume into its --checkpoint-dir, are refused in one
line naming the live run's launcher; the live run's files stay whole and its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.checkpoint import list_checkpoints, verify_checkpoint
from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16",
    "--eval-every", "0", "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
]  # fmt: skip


def test_a_second_run_on_a_live_runs_folders_is_refused_and_the_first_keeps_its_files(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs, ckpt = work / "runs", work / "ckpt_live"
    common = [*TINY, "--data", str(work / "data"), "--set", f"run.out_dir={runs}"]
    first = [
        sys.executable, "-m", "pipetrain.cli", "train", *common, "--name", "live", "--pp", "2",
        "--steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    live = subprocess.Popen(
        first, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    metrics = runs / "live" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 180
        while not list_checkpoints(ckpt).complete:
            assert live.poll() is None and time.monotonic() < deadline, live.communicate()
            time.sleep(0.2)
        config_text = (runs / "live" / "config.toml").read_text()

        # The same --name, its own checkpoints: the run folder is the live run's.
        code = main(["train", *common, "--name", "live", "--pp", "1", "--steps", "2"])
        err = capsys.readouterr().err
        assert code == 2
        assert err.splitlines() == [
            f"pipetrain train: error: the run folder {str(runs / 'live')!r} is in use by a live "
            f"run (process {live.pid} on this host, started "
            + err.split(", started ", 1)[1].split(")", 1)[0]
            + f"): pass another --name, wait for that run to end, or stop it (kill -TERM "
            f"{live.pid} saves and stops it)"
        ]
        # Another --name resuming from the live run's checkpoints: refused before they are
        # read (mid-save) or written.
        resume = ["--name", "late", "--pp", "1", "--steps", "100000", "--resume"]
        code = main(["train", *common, *resume, "--checkpoint-dir", str(ckpt)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1
        assert err.startswith(
            f"pipetrain train: error: --resume into a run that is still alive: the checkpoint "
            f"directory {str(ckpt)!r} is held by process {live.pid} on this host"
        )
        assert not (runs / "late" / "config.toml").exists()
        assert live.poll() is None
    finally:
        os.killpg(live.pid, signal.SIGTERM)  # finishes its step, saves and exits 0
        _, err = live.communicate(timeout=120)
    assert live.returncode == 0, err[-3000:]

    # The live run's files: its config, one trajectory of whole lines, valid checkpoints.
    assert (runs / "live" / "config.toml").read_text() == config_text
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, len(steps) + 1))
    found = list_checkpoints(ckpt)
    assert found.partial == () and found.complete[-1][0] == steps[-1]
    assert all(verify_checkpoint(path).ok for _, path in found.complete)
