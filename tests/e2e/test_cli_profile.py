"""`pipetrain train --profile`: torch.profiler on the chosen steps of every rank, merged.

Two launches of a 2-stage llama-tiny (1F1B, 4 micro-batches, 3 steps): one with
``--profile 2-3`` and one without. The profiled run writes each rank's trace, its top
operators and one merged trace in which every action of steps 2 and 3 is a range on its
rank's track, once per step in the schedule's order, each send's range starting before its
receive's range ends; the losses of the two runs are equal.

The merge moves each rank's clock by the least amount that puts every receive's end after
its send's start, so the merged trace alone would show that order whatever the ranges held.
On one host every rank reads the same clock: there the order must already hold in the
ranks' own traces, before any shift, and the shifts the merge records must stay near 0.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

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


Range = tuple[int, Action, float, float]
Message = tuple[Kind, int, int | None]


def _ranges(events: list[dict[str, Any]], offset_us: float = 0.0) -> list[Range]:
    """(track, action, start, end) of every action range in a trace's events."""
    found = []
    for e in events:
        action = parse_range_name(e.get("name", "")) if e.get("ph") == "X" else None
        if action is not None:
            start = offset_us + e["ts"]
            found.append((e["pid"], action, start, start + e["dur"]))
    return found


def _messages(ranges: list[Range]) -> list[tuple[Message, float, float]]:
    """(message, its send's start, its receive's end) of every message, the n-th send of
    a message paired with its n-th receive (one per profiled step)."""
    sends: dict[Message, list[float]] = {}
    for _, action, start, _ in sorted(ranges, key=lambda r: r[2]):
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            sends.setdefault((action.kind, action.stage, action.microbatch), []).append(start)
    recvs: dict[Message, list[float]] = {}
    for _, action, _, end in sorted(ranges, key=lambda r: r[3]):
        if action.kind is Kind.RECV_F:
            key = (Kind.SEND_F, action.stage - 1, action.microbatch)
        elif action.kind is Kind.RECV_B:
            key = (Kind.SEND_B, action.stage + 1, action.microbatch)
        else:
            continue
        recvs.setdefault(key, []).append(end)
    assert recvs and sorted(recvs) == sorted(sends)
    return [
        (key, start, end)
        for key, ends in recvs.items()
        for start, end in zip(sends[key], ends, strict=True)
    ]


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
    ranges = _ranges(trace["traceEvents"])
    lowered = prepare_schedule("1f1b", 2, 4).lowered
    in_order = sorted(ranges, key=lambda r: r[2])
    for rank in (0, 1):
        # Each action once per profiled step, in the order the rank's program runs them.
        got = [action for track, action, _, _ in in_order if track == rank]
        assert got == list(lowered.actions[rank]) * len(PROFILED), f"rank {rank}"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert {"rank 0", "rank 1"} <= names


def test_sends_start_before_their_receives_end(
    out: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    folder = out / "profiled" / "profile"
    # Each rank's own trace, on the profiler's clock (its base plus each event's ts).
    raw: list[Range] = []
    for rank in (0, 1):
        trace = json.loads((folder / f"rank{rank}.trace.json").read_text())
        base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
        raw += [(rank, *r[1:]) for r in _ranges(trace["traceEvents"], base_us)]
    for key, start, end in _messages(raw):
        assert start <= end, ("unshifted", key)
    merged = json.loads((folder / "trace.json").read_text())
    # The least shifts that order the messages: 0 where the clocks already agree, so at
    # most a rounding's worth, far below a step's millisecond messages.
    shifts = merged["otherData"]["clock_shift_us"]
    assert sorted(shifts) == ["rank 0", "rank 1"]
    assert all(0 <= shift <= 1000 for shift in shifts.values()), shifts
    for key, start, end in _messages(_ranges(merged["traceEvents"])):
        assert start <= end, ("merged", key)


def test_losses_equal_a_run_without_profile(
    out: Path, profiled: subprocess.CompletedProcess[str]
) -> None:
    _train(out, "plain")
    got, want = _losses(out / "profiled"), _losses(out / "plain")
    assert sorted(got) == [1, 2, 3]
    assert got == want
