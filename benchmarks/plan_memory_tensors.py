"""The memory model's count against the tensors a run allocates, as torch's profiler sees
them, beside the resident peak with every tensor mapped.

``plan_memory_live.py`` sets the count against the resident peak of a run with
``run.map_tensors``; on small processes that reading holds megabytes the count does not
(BENCHMARKS.md). This script tells tensors from the rest: each run folder's config trains
again with every tensor mapped and ``--profile`` over every step with
``run.profile_memory``, and each process's tensor peak is the most bytes its ``[memory]``
events hold live at once over the recording, plus the weights, which were allocated before
it (AdamW's state is the weights and two moments of their size: a third of the run's state
bytes). The profiler's own events make that run's resident set meaningless, so the mapped
peak is read from the run folder given (a ``plan_memory_live.py`` run) where asked.

    .venv/bin/python benchmarks/plan_memory_tensors.py --out /tmp/tensors \
        /tmp/pa18/runs-default4/llama-default-w4-budget-2 --mapped /tmp/pa18/live

Prints a table per process; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

_MIB = 2**20
# Tensors under glibc's default mmap threshold stay in the heap even with run.map_tensors.
_MAPPED_FROM = 128 * 1024


def _records(metrics: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for line in metrics.read_text().splitlines():
        merged.update(json.loads(line))
    return merged


def tensor_peak(trace: Path) -> tuple[int, int]:
    """(the most CPU tensor bytes live at once over the recording, of them in tensors
    under the mmap threshold) from a profiler trace's ``[memory]`` events."""
    events = [
        e for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0
    ]  # fmt: skip
    events.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    live: dict[int, int] = {}
    level = peak = small = 0
    for event in events:
        address, size = int(event["args"]["Addr"]), int(event["args"]["Bytes"])
        level += size
        if size > 0:
            live[address] = size
        else:
            live.pop(address, None)
        if level > peak:
            peak = level
            small = sum(b for b in live.values() if b < _MAPPED_FROM)
    return peak, small


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders of a sweep")
    parser.add_argument("--out", type=Path, default=Path("/tmp/plan_memory_tensors"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mapped", type=Path, help="plan_memory_live.py's --out")
    args = parser.parse_args()
    print("| run | process | counted MiB | tensors' peak MiB (under 128 KiB) | gap | "
          "mapped resident peak MiB | beyond the tensors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        name = f"tensors-{run.name}"
        subprocess.run(
            [sys.executable, "-m", "pipetrain.cli", "train", "--config", str(run / "config.toml"),
             "--steps", str(args.steps), "--name", name, "--set", f"run.out_dir={args.out}",
             "--set", "run.map_tensors=true", "--set", f"run.profile=1-{args.steps}",
             "--set", "run.profile_memory=true"],
            check=True, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        records = _records(args.out / name / "metrics.jsonl")
        mapped_file = args.mapped / f"live-{run.name}" / "metrics.jsonl" if args.mapped else None
        mapped = _records(mapped_file)["measured_peak"] if mapped_file else None
        for rank, counted in enumerate(records["predicted_peak"]):
            peak, small = tensor_peak(args.out / name / "profile" / f"rank{rank}.trace.json")
            tensors = peak + records["state_bytes"][rank] / 3
            beyond = (
                f"{mapped[rank] / _MIB:.1f} | {(mapped[rank] - tensors) / _MIB:+.1f}"
                if mapped else "| "
            )  # fmt: skip
            print(f"| {run.name} | {rank} | {counted / _MIB:.1f} | {tensors / _MIB:.1f} "
                  f"({small / _MIB:.1f}) | {(counted - tensors) / tensors:+.1%} | {beyond} |")  # fmt: skip


if __name__ == "__main__":
    main()
