"""Mixture of experts on 4 local processes: expert parallelism against replicated experts,
and the MoE model's convergence against the dense model of the same active width.

Throughput (``--mode throughput``): ``moe-default`` as pp=2 x dp=2 with every expert on
every replica, and as pp=2 x dp=2 x ep=2 (each rank holds 4 of the 8 experts of its
layers); tokens/s and peak memory per rank from each run's summary, parameters + optimizer
state per rank, and the time each rank spent in all-to-all, read from torch.profiler
traces of the profiled steps (``--profile``: the events named ``*all_to_all*``).

Convergence (``--mode convergence``): ``llama-default`` (dense SwiGLU of 384) against
``moe-default`` (8 experts of 192, top-2: the same 384 active per token) on the default
corpus, same seed, batch and learning rate; one PNG of both loss curves and their
evaluation losses.

    .venv/bin/python benchmarks/bench_moe.py --mode throughput --steps 12
    .venv/bin/python benchmarks/bench_moe.py --mode convergence --steps 300 --out docs/moe_convergence.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

COMMON = ["--set", "run.sample_tokens=0"]


def _train(out: Path, name: str, *flags: str) -> list[dict[str, Any]]:
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *COMMON, *flags, "--name", name,
        "--set", f"run.out_dir={json.dumps(str(out))}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    text = (out / name / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _all_to_all_seconds(folder: Path) -> list[float]:
    """Per rank: seconds its process group spent running all-to-alls over the profiled
    steps: the backend's own ranges (``gloo:all_to_all``, one per exchange, forward and
    backward, from its start to its completion, waiting for peers included). The ops that
    enqueue them and the autograd nodes around them would count the same time twice."""
    seconds = []
    for rank in range(4):
        events = json.loads((folder / f"rank{rank}.trace.json").read_text())["traceEvents"]
        total_us = sum(
            e.get("dur", 0)
            for e in events
            if e.get("ph") == "X" and str(e.get("name", "")).endswith(":all_to_all")
        )
        seconds.append(total_us * 1e-6)
    return seconds


def throughput(steps: int) -> None:
    flags = ["--model", "moe-default", "--pp", "2", "--dp", "2", "--steps", str(steps),
             "--eval-every", "0", "--microbatches", "4", "--profile", f"{steps - 1}-{steps}"]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name, extra in (("replicated", []), ("ep2", ["--ep", "2"])):
            records = _train(out, name, *flags, *extra)
            summary = next(r for r in records if r.get("summary"))
            step_s = [r["step_time_s"] for r in records if "step_time_s" in r][-2:]
            a2a = _all_to_all_seconds(out / name / "profile")
            rows.append((name, summary, sum(step_s), a2a))
    print(f"moe-default, pp=2 x dp=2, 4 processes, {steps} steps (the last 2 profiled)")
    print(f"{'layout':<12}{'tokens/s':>10}{'peak MiB per rank':>36}{'state MB/rank':>15}"
          f"{'all-to-all s (2 steps) per rank':>40}{'share':>8}")  # fmt: skip
    for name, summary, step_s, a2a in rows:
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in summary["peak_memory"])
        state = max(summary["state_bytes"]) / 1e6
        share = max(a2a) / step_s if step_s else float("nan")
        print(f"{name:<12}{summary['tokens_per_s']:>10,.0f}{peaks:>36}{state:>15.1f}"
              f"{', '.join(f'{s:.3f}' for s in a2a):>40}{share:>8.1%}")  # fmt: skip


def convergence(steps: int, png: Path) -> None:
    flags = [
        "--pp",
        "2",
        "--dp",
        "2",
        "--steps",
        str(steps),
        "--eval-every",
        str(max(steps // 6, 1)),
    ]
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name, extra in (("dense llama-default", ["--model", "llama-default"]),
                            ("moe-default (ep=2)", ["--model", "moe-default", "--ep", "2"])):  # fmt: skip
            records = _train(out, name.split()[0], *flags, *extra)
            loss = [r["loss"] for r in records if "loss" in r]
            evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
            aux = [r["aux_loss"] for r in records if "aux_loss" in r]
            summary = next(r for r in records if r.get("summary"))
            curves[name] = (loss, evals, aux, summary)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (loss, evals, _, _) in curves.items():
        (line,) = ax.plot(range(1, len(loss) + 1), loss, label=f"{name} train", alpha=0.7)
        ax.plot(*zip(*evals, strict=True), "o", color=line.get_color(), label=f"{name} eval")
    ax.set_xlabel("step (32 sequences of 128 bytes)")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("MoE (8 experts x 192, top-2) against dense (384): same active width")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"{steps} steps, pp=2 x dp=2; curves in {png}")
    for name, (loss, evals, aux, summary) in curves.items():
        last = sum(loss[-20:]) / min(20, len(loss))
        aux_text = f", aux loss {aux[0]:.3f} -> {aux[-1]:.3f}" if aux else ""
        print(f"{name}: eval {evals[0][1]:.4f} -> {evals[-1][1]:.4f}, train (mean of last 20) "
              f"{last:.4f}, {summary['tokens_per_s']:,.0f} tokens/s{aux_text}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("throughput", "convergence"), required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("moe_convergence.png"))
    args = parser.parse_args()
    if args.mode == "throughput":
        throughput(args.steps)
    else:
        convergence(args.steps, args.out)


if __name__ == "__main__":
    main()
