"""Running `pipetrain train` and reading a run's metrics file in the CLI end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def read_records(run: Path) -> list[dict[str, Any]]:
    """The JSON records of a run's ``metrics.jsonl`` (``run``: the run directory or the file)."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    """Step -> training loss of a run's metrics."""
    return {r["step"]: r["loss"] for r in read_records(run) if "loss" in r}


def train_run(out: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pipetrain train ARGS --name NAME`` in a process of its own (the real launcher),
    its run folder under ``out``; asserts that it exited 0."""
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *args, "--name", name,
        "--set", f"run.out_dir={json.dumps(str(out))}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_same_steps(
    got: dict[int, float], want: dict[int, float], steps: list[int], what: str
) -> None:
    """``got`` holds exactly ``steps``, each equal to ``want``'s to 1e-5 relative."""
    assert sorted(got) == steps, what
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"{what}: step {step}"
