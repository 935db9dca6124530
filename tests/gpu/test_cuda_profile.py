"""On CUDA: ``pipetrain train --profile`` records the GPU's work next to the named ranges.

Skipped without CUDA (marker ``gpu``, tests/conftest.py): ``python -m pytest tests/gpu``
runs it on a machine with one. One GPU is enough: the two stages run in one process (the
debug mode), so the merged trace puts each action's range on its pipeline rank's track and
the GPU's streams on tracks of their own. What the CPU tiers cannot check: torch.profiler's
CUDA activities are on (kernels in the merged trace, GPU time in the top operators), and
profiling leaves the run's losses as they were.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipetrain.runtime.ranges import parse_range_name
from pipetrain.schedules import Action, Kind
from pipetrain.schedules.prepare import prepare_schedule

pytestmark = pytest.mark.gpu

PROFILED = (2, 3)


def _train(root: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "pipetrain.cli", "train", "--model", "llama-tiny",
        "--data", str(root / "data"), "--batch-size", "8", "--microbatches", "4",
        "--seq-len", "32", "--steps", "3", "--eval-every", "0", "--name", name,
        "--set", "optim.warmup_steps=1", "--set", "run.sample_tokens=0",
        "--pp", "2", "--single-process", "--schedule", "1f1b", "--device", "cuda", *flags,
    ]  # fmt: skip
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        argv, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _losses(root: Path, name: str) -> list[float]:
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r["loss"] for r in records if "loss" in r and not r.get("summary")]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu-profile")
    data = root / "data"
    data.mkdir()
    words = ["def", "class", "return", "import", "for", "while", "if", "lambda", "self", "x"]
    for i in range(12):
        lines = (" ".join(words[(i + j * 7 + k) % 10] for k in range(10)) for j in range(60))
        (data / f"doc{i:02d}.txt").write_text("\n".join(lines))
    return root


@pytest.fixture(scope="module")
def profiled(root: Path) -> subprocess.CompletedProcess[str]:
    done = _train(root, "profiled", "--profile", f"{PROFILED[0]}-{PROFILED[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_profile_on_cuda_records_kernels_and_the_named_ranges(
    root: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    assert "profile of steps 2-3" in profiled.stdout
    folder = root / "runs" / "profiled" / "profile"
    events = json.loads((folder / "trace.json").read_text())["traceEvents"]

    # The GPU's kernels, on a track of their own (not a rank's host track 0 or 1).
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the merged trace"
    assert all(e["pid"] not in (0, 1) for e in kernels)

    # Every forward of the schedule, once per profiled step, on its pipeline rank's track
    # (the debug mode may split a backward into I and W, so only the forwards are counted).
    forwards: Counter[tuple[int, Action]] = Counter()
    for e in events:
        action = parse_range_name(str(e.get("name", ""))) if e.get("ph") == "X" else None
        if action is not None and action.kind is Kind.F:
            forwards[(e["pid"], action)] += 1
    lowered = prepare_schedule("1f1b", 2, 4).lowered
    want = Counter(
        {(r, a): len(PROFILED) for r in (0, 1) for a in lowered.actions[r] if a.kind is Kind.F}
    )
    assert forwards == want

    # The top operators, by GPU time on CUDA: the first one spent some there.
    table = (folder / "rank0_top_ops.txt").read_text().splitlines()
    assert table[0].split()[3:5] == ["self", "gpu"]
    assert float(table[1].split()[1]) > 0, table[:3]


def test_profile_on_cuda_leaves_the_losses_as_they_were(
    root: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    plain = _train(root, "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    got, want = _losses(root, "profiled"), _losses(root, "plain")
    assert len(got) == 3
    # The same kernels in the same order; 1e-5 leaves room for CUDA's atomics (as the
    # other CUDA tests do), far below what a changed step would move.
    assert got == pytest.approx(want, rel=1e-5)
