"""`pipetrain train --profile`: torch.profiler on the chosen steps of every rank, merged.

Two launches of a 2-stage llama-tiny (1F1B, 4 micro-batches, 3 steps): one with
``--profile 2-3`` and one without. The profiled run writes each rank's trace, its top
operators and one merged trace in which every action of steps 2 and 3 is a range on its
rank's track, each send's range starting before its receive's range ends; the losses of
the two runs are equal.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from run_records import losses as _losses
from run_records import train_run

from pipetrain.runtime.ranges import parse_range_name
from pipetrain.schedules import Action, Kind
from pipetrain.schedules.prepare import prepare_schedule

pytestmark = pytest.mark.e2e

PROFILED = (2, 3)
TINY = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "3", "--batch-size", "8",
    "--seq-len", "16", "--microbatches", "4", "--eval-every", "0",
    "--set", "data.max_bytes=100000", "--set", "optim.warmup_steps=1",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1",
]  # fmt: skip


def _train(out: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return train_run(out, name, *TINY, *flags)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profile")


@pytest.fixture(scope="module")
def profiled(out: Path) -> subprocess.CompletedProcess[str]:
    return _train(out, "profiled", "--profile", f"{PROFILED[0]}-{PROFILED[-1]}")


def _ranges(trace: dict[str, object]) -> list[tuple[int, Action, float, float]]:
    """(track, action, start, end) of every action range in a merged trace."""
    found = []
    for e in trace["traceEvents"]:  # type: ignore[attr-defined]
        action = parse_range_name(e.get("name", "")) if e.get("ph") == "X" else None
        if action is not None:
            found.append((e["pid"], action, e["ts"], e["ts"] + e["dur"]))
    return found


def test_profile_writes_each_rank_and_a_merged_trace(
    out: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    folder = out / "profiled" / "profile"
    for rank in (0, 1):
        assert (folder / f"rank{rank}.trace.json").is_file()
        table = (folder / f"rank{rank}_top_ops.txt").read_text().splitlines()
        assert table[0].split()[-1] == "operator" and len(table) > 5
    assert "profile of steps 2-3" in profiled.stdout
    trace = json.loads((folder / "trace.json").read_text())
    ranges = _ranges(trace)
    lowered = prepare_schedule("1f1b", 2, 4).lowered
    for rank in (0, 1):
        got = Counter(action for track, action, _, _ in ranges if track == rank)
        want = Counter({a: len(PROFILED) for a in lowered.actions[rank]})
        assert got == want, f"rank {rank}"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names


def test_sends_start_before_their_receives_end(
    out: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    ranges = _ranges(json.loads((out / "profiled" / "profile" / "trace.json").read_text()))
    sends: dict[tuple[Kind, int, int | None], list[float]] = {}
    for _, action, start, _ in sorted(ranges, key=lambda r: r[2]):
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            sends.setdefault((action.kind, action.stage, action.microbatch), []).append(start)
    recvs: dict[tuple[Kind, int, int | None], list[float]] = {}
    for _, action, _, end in sorted(ranges, key=lambda r: r[3]):
        if action.kind is Kind.RECV_F:
            key = (Kind.SEND_F, action.stage - 1, action.microbatch)
        elif action.kind is Kind.RECV_B:
            key = (Kind.SEND_B, action.stage + 1, action.microbatch)
        else:
            continue
        recvs.setdefault(key, []).append(end)
    assert recvs and sorted(recvs) == sorted(sends)
    for key, ends in recvs.items():
        # The n-th receive of a message (one per profiled step) and the n-th send.
        for start, end in zip(sends[key], ends, strict=True):
            assert start <= end, key


def test_losses_equal_a_run_without_profile(
    out: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    _train(out, "plain")
    got, want = _losses(out / "profiled"), _losses(out / "plain")
    assert sorted(got) == [1, 2, 3]
    assert got == want
