"""The memory model's count against the tensors' bytes a run holds: every run folder of a
``plan_auto.py`` sweep trained again for a few steps with ``run.map_tensors`` (each tensor of
128 KiB or more mapped on its own, so the resident peak leaves out the heap's holes), and
each process's measured peak set against the count of docs/memory_model.md (weights,
gradients, AdamW state, the simulated peak of activations with the split backward's terms,
buffers; no workspace) at the run's own split, and against what the mapped run's own summary
predicted for it (its memory check, the reading the trainer prints).

    .venv/bin/python benchmarks/plan_memory_live.py --out /tmp/live \
        '/tmp/pa/runs-default/llama-default-w4-r0-*' '/tmp/pa/runs-default/llama-default-w2-r0-*'

With ``--reuse`` the mapped runs already in ``--out`` are read instead of trained again,
which sets a changed count against measured peaks in seconds.

Prints a table per process and the largest and mean gaps; BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
from pathlib import Path

from plan_memory_fit import counted_processes

_MIB = 2**20


def _mapped_peaks(run: Path, out: Path, steps: int, reuse: bool) -> tuple[list[float], list[float]]:
    """The run's config trained again with every tensor mapped (``reuse``: the mapped run
    already in ``out``, where there is one): its processes' measured peaks and what its run
    summary predicted for them when it ran, MiB."""
    name = f"live-{run.name}"
    if not (reuse and (out / name / "metrics.jsonl").is_file()):
        command = [sys.executable, "-m", "pipetrain.cli", "train", "--config",
                   str(run / "config.toml"), "--name", name, "--steps", str(steps),
                   "--set", f"run.out_dir={out}", "--set", "run.map_tensors=true"]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    check = next(r for r in map(json.loads, lines) if r.get("memory_check"))
    return (
        [peak / _MIB for peak in check["measured_peak"]],
        [peak / _MIB for peak in check["predicted_peak"]],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders of a sweep, or patterns of them")
    p.add_argument("--out", type=Path, required=True, help="folder for the runs made here")
    p.add_argument("--steps", type=int, default=4, help="steps a run (default 4)")
    p.add_argument("--reuse", action="store_true",
                   help="read the mapped runs already in --out instead of training them again: "
                        "the count is the current code's, the summary's prediction theirs")  # fmt: skip
    args = p.parse_args()
    gaps, said = [], []
    print("| run | layout | process | counted MiB | measured MiB | gap | run summary's "
          "prediction MiB | its gap |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for run in (Path(r) for pattern in args.runs for r in sorted(glob.glob(pattern))):
        counted = counted_processes(run)
        if not counted:
            continue
        measured, predicted = _mapped_peaks(run, args.out, args.steps, args.reuse)
        for process, (row, live, summary) in enumerate(
            zip(counted, measured, predicted, strict=True)
        ):
            gaps.append(row[2] / live - 1)
            said.append(summary / live - 1)
            print(f"| {run.name} | {row[0]} | {process} | {row[2]:.1f} | {live:.1f} | "
                  f"{gaps[-1]:+.1%} | {summary:.1f} | {said[-1]:+.1%} |")  # fmt: skip
    if not gaps:
        raise SystemExit(
            "no run folder with a memory check matched: pass plan_auto.py's --out runs"
        )
    print(f"\n{len(gaps)} processes: the count within {max(map(abs, gaps)):.1%} of the mapped "
          f"peak at most, {sum(map(abs, gaps)) / len(gaps):.1%} on average; the run "
          f"summary's prediction within {max(map(abs, said)):.1%} at most, "
          f"{sum(map(abs, said)) / len(said):.1%} on average")  # fmt: skip


if __name__ == "__main__":
    main()
