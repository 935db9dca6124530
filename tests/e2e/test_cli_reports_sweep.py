"""What ``pipetrain train`` reports about an asynchronous run (pipedream), end to end.

One 2-process run of 4 steps in streams of 2 with ``--timeline``, then the same run
resumed in one process up to step 6: the picture, the per-step bubble, the simulated
bubble and the summary's step count must describe what each of them trained.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--schedule", "pipedream", "--pp", "2", "--batch-size", "8",
    "--microbatches", "4", "--seq-len", "16", "--checkpoint-every", "2",
    "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
    "--set", "data.eval_batches=1", "--set", "pipeline.threads=1",
]  # fmt: skip


def train(work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, "--data", str(work / "data"),
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
