"""Convergence and throughput: synchronous (GPipe, 1F1B, ZB-H1) against asynchronous
(PipeDream, PipeDream-2BW) pipelines, the same model, seed, data and samples.

Each schedule is one ``pipetrain train`` run on ``--pp`` local processes (the real
launcher), on the default corpus, with the same learning rate and schedule; the runs'
metrics files give the loss of every step, the wall time of every step, the evaluation
losses, tokens/s and peak memory. One PNG: training loss against samples and against
wall time, evaluation losses as markers; a table on stdout (and ``--json``).

    .venv/bin/python benchmarks/convergence.py [--steps 40] [--pp 2] [--out convergence.png]
        [--schedules gpipe 1f1b zb-h1 pipedream pipedream-2bw] [--json results.json]

An asynchronous run is cut into streams at the evaluations (``stream_steps`` = eval
interval): the pipeline drains only there. Its tokens/s counts every stream, while a
synchronous run leaves its first step out (allocation), which favours the synchronous
runs slightly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "pipedream", "pipedream-2bw")


@dataclass(frozen=True)
class RunResult:
    schedule: str
    samples: list[int]  # after each step
    wall_s: list[float]  # cumulative step time after each step
    loss: list[float]
    eval_steps: list[int]
    eval_loss: list[float]
    tokens_per_s: float
    final_eval_loss: float
    peak_mib: float  # the largest rank's
    weight_versions: list[int] | None


def run_one(schedule: str, args: argparse.Namespace, out_dir: Path) -> RunResult:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train",
        "--model", args.model, "--pp", str(args.pp), "--schedule", schedule,
        "--steps", str(args.steps), "--batch-size", str(args.batch_size),
        "--microbatches", str(args.microbatches), "--seq-len", str(args.seq_len),
        "--lr", str(args.lr), "--seed", str(args.seed), "--eval-every", str(args.eval_every),
        "--name", schedule, "--set", f"run.out_dir={json.dumps(str(out_dir))}",
        "--set", "run.sample_tokens=0", "--set", f"optim.warmup_steps={args.warmup}",
        "--set", f"data.eval_batches={args.eval_batches}", "--set", "pipeline.threads=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{schedule}: pipetrain train failed:\n{done.stderr[-2000:]}")
    records = [
        json.loads(line) for line in (out_dir / schedule / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    summary = next(r for r in records if r.get("summary"))
    versions = next((r["weight_versions"] for r in records if "weight_versions" in r), None)
    wall, clock = [], 0.0
    for r in steps:
        clock += r["step_time_s"]
        wall.append(clock)
    return RunResult(
        schedule=schedule,
        samples=[r["step"] * args.batch_size for r in steps],
        wall_s=wall,
        loss=[r["loss"] for r in steps],
        eval_steps=[r["step"] for r in evals],
        eval_loss=[r["eval_loss"] for r in evals],
        tokens_per_s=summary["tokens_per_s"],
        final_eval_loss=summary["final_eval_loss"],
        peak_mib=max(summary["peak_memory"]) / 2**20,
        weight_versions=versions,
    )


def draw(results: list[RunResult], batch_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for res in results:
        dashed = "--" if res.schedule.startswith("pipedream") else "-"
        (line,) = by_samples.plot(res.samples, res.loss, dashed, label=res.schedule, lw=1.2)
        by_samples.plot(
            [s * batch_size for s in res.eval_steps], res.eval_loss, "o", color=line.get_color()
        )
        by_time.plot(res.wall_s, res.loss, dashed, color=line.get_color(), label=res.schedule)
    by_samples.set(
        xlabel="samples", ylabel="training loss (dots: eval loss)", title="loss vs samples"
    )
    by_time.set(
        xlabel="wall time of the steps (s)", ylabel="training loss", title="loss vs wall time"
    )
    for ax in (by_samples, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[RunResult]) -> str:
    rows = [
        f"{'schedule':<15} {'tokens/s':>9} {'final eval':>10} {'peak MiB':>9}  weight versions",
    ]
    for res in results:
        versions = "-" if res.weight_versions is None else str(res.weight_versions)
        rows.append(
            f"{res.schedule:<15} {res.tokens_per_s:>9,.0f} {res.final_eval_loss:>10.4f} "
            f"{res.peak_mib:>9.0f}  {versions}"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("convergence.png"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        results = []
        for schedule in args.schedules:
            print(f"training {schedule} ...", file=sys.stderr, flush=True)
            results.append(run_one(schedule, args, Path(tmp)))
    draw(results, args.batch_size, args.out)
    print(table(results))
    print(f"\nplot: {args.out}")
    if args.json is not None:
        payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
        payload["runs"] = [asdict(r) for r in results]
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
