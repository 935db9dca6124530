"""``pipetrain train --schedule pipedream / pipedream-2bw`` end to end (2 local processes).

Per schedule: one run of 8 steps with a checkpoint every 4 (the loss goes down, the
summary reports the live weight versions next to the simulator's), then a run resumed
from its step-4 checkpoint, which must continue bit for bit.

What ``pipetrain train`` reports about an asynchronous run: one 2-process run of 4 steps
in streams of 2 with ``--timeline``, then the same run resumed in one process up to step
6: the picture, the per-step bubble, the simulated bubble and the summary's step count
must describe what each of them trained, and generate reads its checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.checkpoint import list_checkpoints, read_weights

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "8", "--batch-size", "8",
    "--microbatches", "4", "--seq-len", "16", "--lr", "3e-3", "--eval-every", "4",
    "--checkpoint-every", "4", "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
    "--set", "data.eval_batches=2",
]  # fmt: skip
SCHEDULES = {"pipedream": [2, 1], "pipedream-2bw": [2, 2]}


def run_train(work: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--data", str(work / "data"),
        "--name", name, "--set", f"run.out_dir={work / 'runs'}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def records(work: Path, name: str) -> list[dict[str, Any]]:
    lines = (work / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(work: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(work, name) if "loss" in r}


@pytest.fixture(scope="module")
def full(work: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    return {
        schedule: run_train(
            work,
            schedule,
            "--schedule",
            schedule,
            "--checkpoint-dir",
            str(work / f"ckpt-{schedule}"),
        )
        for schedule in SCHEDULES
    }


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trains_and_reports_versions(work: Path, full: Any, schedule: str) -> None:
    result = full[schedule]
    assert "streams of 4 steps x 4 micro-batches" in result.stdout
    got = losses(work, schedule)
    assert sorted(got) == list(range(1, 9))
    assert sum(got[s] for s in (7, 8)) < sum(got[s] for s in (1, 2)) - 0.2, got
    evals = [r["eval_loss"] for r in records(work, schedule) if "eval_loss" in r]
    assert len(evals) == 3 and evals[2] < evals[1] < evals[0], evals
    versions = [r for r in records(work, schedule) if "weight_versions" in r]
    assert versions and versions[0]["weight_versions"] == SCHEDULES[schedule]
    assert max(versions[0]["predicted_weight_versions"]) == 2
    assert f"weight versions per rank: at most {SCHEDULES[schedule]} alive at once" in result.stdout


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_continues_bit_for_bit(work: Path, full: Any, schedule: str) -> None:
    saved = work / f"ckpt-{schedule}"
    assert [s for s, _ in list_checkpoints(saved).complete] == [4, 8]
    resumed = work / f"resumed-{schedule}"
    resumed.mkdir()
    shutil.copytree(saved / "step_000004", resumed / "step_000004")
    name = f"{schedule}-resumed"
    run_train(work, name, "--schedule", schedule, "--checkpoint-dir", str(resumed), "--resume")
    expected = losses(work, schedule)
    got = losses(work, name)
    assert got == {s: expected[s] for s in range(5, 9)}  # bit-exact
    a, _ = read_weights(saved / "step_000008")
    b, _ = read_weights(resumed / "step_000008")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_combination_is_one_line(work: Path) -> None:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--schedule", "1f1b",
        "--vertical-sync", "--data", str(work / "data"), "--checkpoint-dir", str(work / "unused"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "drop --vertical-sync" in lines[0], result.stderr


# PipeDream on 2 ranks, a checkpoint every 2 steps: what a run and its resumption report.
TINY_STREAMS = [
    "--model", "llama-tiny", "--schedule", "pipedream", "--pp", "2", "--batch-size", "8",
    "--microbatches", "4", "--seq-len", "16", "--checkpoint-every", "2",
    "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
    "--set", "data.eval_batches=1", "--set", "pipeline.threads=1",
]  # fmt: skip


def train(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY_STREAMS, "--data", str(work / "data"),
        "--name", "pd", "--set", f"run.out_dir={work / 'runs'}",
        "--checkpoint-dir", str(work / "ckpt"), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def summaries(work: Path) -> list[dict[str, Any]]:
    lines = (work / "runs" / "pd" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("summary")]


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Any]:
    first = train(work, "--steps", "4", "--timeline", str(work / "last.png"))
    first_summary = summaries(work)[-1]
    steps = [
        json.loads(line)
        for line in (work / "runs" / "pd" / "metrics.jsonl").read_text().splitlines()
    ]
    resumed = train(work, "--steps", "6", "--resume", "--single-process")
    return {
        "first": first,
        "first_summary": first_summary,
        "records": [r for r in steps if "loss" in r],
        "resumed": resumed,
        "resumed_summary": summaries(work)[-1],
    }


def test_timeline_of_the_last_stream_is_drawn(work: Path, runs: dict[str, Any]) -> None:
    picture = work / "last.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"timeline of the last stream (steps 3-4) drawn to {picture}" in runs["first"].stdout


def test_bubbles_measured_per_step_and_simulated(runs: dict[str, Any]) -> None:
    records = runs["records"]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0.0 < r["bubble"] < 1.0 for r in records), records
    summary = runs["first_summary"]
    assert 0.0 < summary["measured_bubble"] < 1.0
    assert summary["simulated_bubble"] is not None and 0.0 <= summary["simulated_bubble"] < 1.0
    assert (
        "bubble: measured" in runs["first"].stdout and "simulated n/a" not in runs["first"].stdout
    )


def test_resumed_summary_counts_the_steps_it_trained(runs: dict[str, Any]) -> None:
    summary = runs["resumed_summary"]
    assert summary["steps"] == 2 and summary["tokens"] == 2 * 8 * 16, summary
    assert "trained 2 steps, 256 tokens" in runs["resumed"].stdout
    # One process measures no bubble, but the simulator still replays the measured times.
    assert summary["measured_bubble"] is None
    assert math.isfinite(summary["simulated_bubble"])


def test_generate_from_the_async_checkpoint_at_a_tiny_temperature(
    work: Path, runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from pipetrain.cli import main

    texts = []
    # 1e-45 was a RuntimeError traceback from multinomial (every logit divided to +-inf).
    for temperature in ("0", "1e-45"):
        argv = ["generate", "--checkpoint", str(work / "ckpt"), "--prompt", "def "]
        code = main([*argv, "--max-new-tokens", "8", "--temperature", temperature])
        out, err = capsys.readouterr()
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1] and texts[0].startswith("def ")
