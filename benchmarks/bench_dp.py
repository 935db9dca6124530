"""Pipeline x data x tensor parallelism at an equal number of processes: pp=4, pp=2 x
dp=2, dp=4, pp=2 x tp=2, tp=4.

    .venv/bin/python benchmarks/bench_dp.py [--model llama-default] [--steps 6] [--reps 2]
                                            [--batch-size 32] [--seq-len 128] [--rows 4]
                                            [--layouts "pp=2 x dp=2,pp=2 x tp=2"]

Each layout trains the same global batch through ``pipetrain train`` (the real launcher,
4 local processes, 1F1B, evaluation and sampling off) with micro-batches of ``--rows``
sequences everywhere, so the layouts differ only in how the work is spread: pp=4 runs
32/4 = 8 micro-batches through 4 stages; pp=2 x dp=2 runs 16 rows per replica in 4
micro-batches through 2 stages; dp=4 runs 8 rows per replica in 2 micro-batches of the
whole model. "pp=2 x dp=2 --shard" is the mixed layout with each stage sharded over its
replicas (FSDP2) instead of replicated; "--grad-as-bucket-view" keeps the replicas'
gradients as views of persistent all-reduce buckets. ``--set FIELD=VALUE`` (repeatable)
goes to every run, e.g. ``--set run.map_tensors=true`` to measure the tensors' bytes.
With tensor parallelism the tp ranks of a stage share its micro-batches: pp=2 x tp=2 runs 8 micro-batches through 2 stages whose layers
are split over 2 processes each; tp=4 runs them through one stage split over 4. tokens/s is the run summary's (steps after the first, all replicas
together). The layouts alternate within each repetition; the table shows medians.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# (label, pp, dp, tp, extra flags)
LAYOUTS: tuple[tuple[str, int, int, int, tuple[str, ...]], ...] = (
    ("pp=4", 4, 1, 1, ()),
    ("pp=2 x dp=2", 2, 2, 1, ()),
    ("pp=2 x dp=2 --shard", 2, 2, 1, ("--shard",)),
    ("pp=2 x dp=2 --grad-as-bucket-view", 2, 2, 1, ("--grad-as-bucket-view",)),
    ("dp=4", 1, 4, 1, ()),
    ("dp=4 --grad-as-bucket-view", 1, 4, 1, ("--grad-as-bucket-view",)),
    ("pp=2 x tp=2", 2, 1, 2, ()),
    ("pp=2 x tp=2 --sequence-parallel", 2, 1, 2, ("--sequence-parallel",)),
    ("tp=4", 1, 1, 4, ()),
)


def run(
    args: argparse.Namespace,
    layout: tuple[str, int, int, int, tuple[str, ...]],
    out: Path,
    name: str,
) -> dict[str, Any]:
    _, pp, dp, tp, extra = layout
    microbatches = args.batch_size // (dp * args.rows)
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", "--model", args.model,
        "--pp", str(pp), "--dp", str(dp), "--tp", str(tp), *extra,
        "--microbatches", str(microbatches),
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--steps", str(args.steps), "--name", name,
        "--set", f"run.out_dir={json.dumps(str(out))}", "--set", "run.evaluate=false",
        "--set", "run.sample_tokens=0", "--set", "optim.warmup_steps=1",
        *(flag for field in args.set for flag in ("--set", field)),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r.get("summary"))
    steps = [r for r in records if "loss" in r][1:]
    dp_record: dict[str, Any] = next((r for r in records if "dp_wait_s" in r), {})
    check: dict[str, Any] = next((r for r in records if r.get("memory_check")), {})
    return {
        "tokens_per_s": float(summary["tokens_per_s"]),
        "step_s": statistics.median(r["step_time_s"] for r in steps),
        "bubble": float(summary["measured_bubble"] or 0.0),
        # The slowest pipeline rank's wait, the largest rank's share of the gradients.
        "dp_wait_ms": 1e3 * max(dp_record.get("dp_wait_s", [0.0])),
        "dp_mb": max(dp_record.get("dp_bytes_per_step", [0])) / 1e6,
        # The memory check's measured peak (docs/memory_model.md: the resident peak less
        # the process's baseline, plus the weights; on CUDA the allocator's).
        "peak_mib": max(check["measured_peak"]) / 2**20,
        "peaks_mib": [b / 2**20 for b in check["measured_peak"]],
        # The run's memory check: the count of docs/memory_model.md for its fullest process.
        "predicted_mib": max(check.get("predicted_peak") or [math.nan]) / 2**20,
        # Parameters + AdamW state of the largest rank, and of rank 0 (the first stage's
        # first tp rank).
        "state_mb": max(summary.get("state_bytes") or [math.nan]) / 1e6,
        "state0_mb": (summary.get("state_bytes") or [math.nan])[0] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-default")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a config field for every run (repeatable)")  # fmt: skip
    parser.add_argument(
        "--layouts",
        default=",".join(label for label, *_ in LAYOUTS),
        help="comma-separated labels of the layouts to run",
    )
    args = parser.parse_args()
    wanted = [label.strip() for label in args.layouts.split(",")]
    unknown = [label for label in wanted if label not in {lay[0] for lay in LAYOUTS}]
    if unknown:
        raise SystemExit(
            f"unknown layout(s) {unknown}: choose from {', '.join(lay[0] for lay in LAYOUTS)}"
        )
    layouts = [lay for lay in LAYOUTS if lay[0] in wanted]
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for layout in layouts:
                label = layout[0]
                name = f"{label.replace(' ', '').replace('=', '').replace('--', '-')}-{rep}"
                results[label].append(run(args, layout, Path(tmp), name))
                print(f"# rep {rep}: {label}: {results[label][-1]}", file=sys.stderr, flush=True)
    print(
        f"model {args.model}, batch {args.batch_size} x {args.seq_len}, micro-batches of "
        f"{args.rows}, 1F1B, {args.steps} steps (first left out), medians of {args.reps}"
        + "".join(f", --set {field}" for field in args.set)
        + "\n"
    )
    print(
        "| layout | tokens/s | step s | measured bubble | dp all-reduce MB/step/rank "
        "| dp wait ms/step | peak MiB, largest rank | counted MiB, largest rank "
        "| peak MiB, rank 0, 1, ... | params + AdamW MB/rank (largest, rank 0) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, *_ in layouts:
        rows = results[label]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return float(statistics.median(r[key] for r in rows))

        peaks = ", ".join(
            f"{statistics.median(p):.0f}" for p in zip(*(r["peaks_mib"] for r in rows), strict=True)
        )

        print(
            f"| {label} | {med('tokens_per_s'):,.0f} | {med('step_s'):.2f} | "
            f"{med('bubble'):.1%} | {med('dp_mb'):.1f} | {med('dp_wait_ms'):.0f} | "
            f"{med('peak_mib'):.0f} | {med('predicted_mib'):.0f} | {peaks} | "
            f"{med('state_mb'):.2f}, {med('state0_mb'):.2f} |"
        )


if __name__ == "__main__":
    main()
