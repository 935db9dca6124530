"""`pipetrain train` end to end: a short run on the default data, its outputs, and the
loss-independence matrix (per-step losses equal to 1e-5 relative against --pp 1).

Few launches: the tiny model, 5 steps, small batches. The single-process cases run the
CLI in this process; the multi-process ones go through the real launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import main

pytestmark = pytest.mark.e2e

# The tiny model on a small slice of the default corpus: seconds per run.
TINY = [
    "--model", "llama-tiny", "--steps", "5", "--batch-size", "8", "--seq-len", "32",
    "--microbatches", "4", "--set", "data.max_bytes=100000", "--set", "optim.warmup_steps=1",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1",
]  # fmt: skip


def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`pipetrain ...` as a user runs it; a timeout takes every process it started down."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(path: Path) -> list[float]:
    return [r["loss"] for r in _records(path) if "loss" in r]


def _assert_same_losses(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == 5, what
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {step + 1} loss {a} vs {b} with --pp 1"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step losses of --pp 1, the one-process reference."""
    out = tmp_path_factory.mktemp("ref")
    assert (
        main(
            [
                "train",
                *TINY,
                "--pp",
                "1",
                "--name",
                "ref",
                "--set",
                f"run.out_dir={json.dumps(str(out))}",
            ]
        )
        == 0
    )
    return _losses(out / "ref" / "metrics.jsonl")


def test_short_run_on_the_default_data(tmp_path: Path) -> None:
    done = _cli(
        "train", "--model", "llama-tiny", "--pp", "2", "--steps", "3", "--batch-size", "8",
        "--seq-len", "32", "--microbatches", "2", "--name", "e2e", "--set", "data.max_bytes=200000",
        "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=16", "--set", "data.eval_batches=1",
        "--timeline", "step.png",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "e2e"
    # The resolved config is printed and saved, and reads back.
    saved = (run_dir / "config.toml").read_text()
    assert saved in done.stdout
    assert 'name = "llama-tiny"' in saved and "pp = 2" in saved
    records = _records(run_dir / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "bubble"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert r["tokens"] == 8 * 32
        assert 0.0 <= r["bubble"] < 1.0
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]
    summary = records[-1]
    assert summary["summary"] is True and len(summary["peak_memory"]) == 2
    assert summary["measured_bubble"] is not None and summary["simulated_bubble"] is not None
    # Plain lines (stdout is not a terminal), the summary, the sample; rank 1 stays quiet.
    assert "\r" not in done.stdout
    assert "step 3/3  loss" in done.stdout
    assert "Python" in done.stdout and "standard library" in done.stdout
    assert "peak memory per rank:" in done.stdout and "sample (temperature" in done.stdout
    assert (tmp_path / "step.png").stat().st_size > 1000
    assert done.stdout.count("eval loss after 3 steps") == 1


@pytest.mark.parametrize(
    "flags",
    [
        ("--pp", "2", "--single-process"),
        ("--pp", "2", "--single-process", "--schedule", "gpipe"),
        ("--pp", "2", "--single-process", "--schedule", "interleaved-1f1b", "--chunks", "2"),
        ("--pp", "4", "--single-process", "--schedule", "zb-h1"),
        ("--pp", "2", "--single-process", "--schedule", "zb-v"),
    ],
    ids=lambda flags: " ".join(flags),
)
def test_loss_does_not_depend_on_the_split_in_one_process(
    reference: list[float], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    assert (
        main(
            [
                "train",
                *TINY,
                *flags,
                "--name",
                "x",
                "--set",
                f"run.out_dir={json.dumps(str(tmp_path))}",
            ]
        )
        == 0
    )
    _assert_same_losses(_losses(tmp_path / "x" / "metrics.jsonl"), reference, " ".join(flags))


@pytest.mark.parametrize(
    "flags",
    [
        ("--pp", "2"),
        ("--pp", "2", "--schedule", "interleaved-1f1b", "--chunks", "2"),
    ],
    ids=lambda flags: " ".join(flags),
)
def test_loss_does_not_depend_on_the_split_across_processes(
    reference: list[float], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    done = _cli("train", *TINY, *flags, "--name", "x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_losses(
        _losses(tmp_path / "runs" / "x" / "metrics.jsonl"), reference, " ".join(flags)
    )


def test_bad_setting_is_one_line_before_any_process_starts(tmp_path: Path) -> None:
    done = _cli("train", "--pp", "2", "--microbatches", "5", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "data.batch_size 32 is not a multiple of pipeline.microbatches 5" in done.stderr
    assert not (tmp_path / "runs").exists()
