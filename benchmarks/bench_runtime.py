"""Our runtime against torch.distributed.pipelining, 2 processes, one thread each.

Same model (``--model``, default llama-default), same split and same initial weights on
both sides (each stage is a ``pipetrain.models.build_stage``), batch 32 x 128, AdamW step
included. For each micro-batch count, each pair of rows runs alternately (ours, torch's)
for ``--rounds`` rounds; the table gives the median tokens/s, the peak RSS of the
larger rank (VmHWM, reset before each run), and, for ours, the measured step time and
action span against the simulator's makespan replayed with the measured median action
times, and the CPU seconds per step of both ranks together (waiting excluded: the work
each side does, whatever the load of the machine). Both sides train on the same batches from the same weights, so their last losses
agree: the check that the two sides do the same work.

    .venv/bin/python benchmarks/bench_runtime.py [--microbatches 4 8 16] [--steps 3]
        [--rounds 2] [--json out.json]

``--paired N`` measures the throughput ratio alone, more finely: both pipelines live in
the same two processes and step in turn (ours, torch's, torch's, ours, ...), N timed
steps each, so that the machine's drift falls on both alike; the table gives the median
tokens/s of each side and the geometric mean of the per-step ratios with a 95%
bootstrap interval.

``--heap keep`` (the default) fixes glibc's heap thresholds in both processes, as
``pipetrain train`` does (``pipetrain.heap``): under glibc's dynamic ones, whichever side
frees the top of the heap at the end of its step pays its pages again at the next (page
faults, system time), which depends on what each side happens to keep alive between
steps, not on its work. ``--heap glibc`` leaves glibc as it is.

Rows (``--only`` takes their labels): gpipe / ScheduleGPipe, 1f1b / Schedule1F1B, zb-h1 /
ScheduleInterleavedZeroBubble on one stage per rank (its ZB1P ordering on one stage per
rank is ZB-H1's, action for action), interleaved-1f1b (v=2) / ScheduleInterleaved1F1B
(v=2): the issue's four pairs, each side on the same stages. Two more rows compare zero
bubble on two stages per rank: zb-h1-vs-looped, our ZB-H1 (one stage per rank) against
ScheduleInterleavedZeroBubble on two (looped: a different split and a smaller bubble),
and zb-v / ScheduleZBVZeroBubble (both V-shaped, two stages per rank).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.launch.process_exit import exit_rank
from pipetrain.schedules import Kind

BATCH, SEQ = 32, 128


@dataclass(frozen=True)
class Pair:
    """One row: our schedule against torch's, with torch's stages per rank and where they
    sit (looped: stage s on rank s mod p; v: rank r holds r and 2p - 1 - r)."""

    label: str
    ours: str
    torch: str
    v: int = 1
    torch_placement: str = "looped"

    @property
    def torch_name(self) -> str:
        return f"{self.torch} v={self.v}"


PAIRS = (
    Pair("gpipe", "gpipe", "ScheduleGPipe"),
    Pair("1f1b", "1f1b", "Schedule1F1B"),
    Pair("zb-h1", "zb-h1", "ScheduleInterleavedZeroBubble"),
    Pair("interleaved-1f1b", "interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
    Pair("zb-h1-vs-looped", "zb-h1", "ScheduleInterleavedZeroBubble", 2),
    Pair("zb-v", "zb-v", "ScheduleZBVZeroBubble", 2, "v"),
)
# The four pairs, run by default; the others with --only.
DEFAULT = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b")


def reset_peak_rss() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
    # Contiguous: torch 2.11+ pipelining checks the strides of stage inputs.
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def release_memory() -> None:
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def timed_steps(step_fn: Any, steps: int) -> tuple[float, float]:
    """Wall seconds per step (slowest rank) and CPU seconds per step (both ranks summed)
    over ``steps`` steps after one warm-up. CPU time does not count waiting, so on a
    shared machine it tells the work each side does apart from the load of others."""
    step_fn(0)
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        step_fn(1 + i)
    elapsed = torch.tensor([time.perf_counter() - start])
    cpu = torch.tensor([time.process_time() - cpu_start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(elapsed) / steps, float(cpu) / steps


def make_ours(spec: Any, name: str, m: int, early: bool = True) -> tuple[Any, Any]:
    """Our pipeline and AdamW: (step function, last result). ``early``: early input
    gradients (build_pipeline's default), else every B whole."""
    from pipetrain.runtime import build_pipeline

    pipe = build_pipeline(
        spec,
        schedule=name,
        microbatches=m,
        group=dist.group.WORLD,
        device="cpu",
        seed=0,
        early_grads=early,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    last: list[Any] = []

    def step(i: int) -> None:
        x, y = batch(i)
        last[:] = [pipe.step(x, y)]
        opt.step()
        pipe.zero_grad()

    return step, (pipe, last)


def run_ours(spec: Any, name: str, m: int, steps: int, early: bool) -> dict[str, float]:
    from pipetrain.runtime.timeline import compare_with_simulation

    step, (pipe, last) = make_ours(spec, name, m, early)
    per_step, cpu = timed_steps(step, steps)
    result = last[0]
    comparison = compare_with_simulation(result.timeline, pipe.schedule)
    return {
        "step_s": per_step,
        "cpu_s": cpu,
        "loss": result.loss,
        "measured_step_s": result.step_time_s,
        "measured_span_s": comparison.measured_makespan_s,
        "simulated_s": comparison.simulated_makespan_s,
        "bubble_measured": comparison.measured_bubble.idle_fraction,
        "bubble_simulated": comparison.simulated_bubble.idle_fraction,
    }


def make_torch(spec: Any, pair: Pair, m: int) -> tuple[Any, list[torch.Tensor]]:
    """torch.distributed.pipelining's schedule on the same stages: (step function, the
    last step's micro-batch losses on the last stage's rank)."""
    from torch.distributed import pipelining

    from pipetrain.models import build_stage
    from pipetrain.runtime import even_split

    rank, p = dist.get_rank(), dist.get_world_size()
    v = pair.v
    n = p * v
    split = even_split(len(spec), n)
    if pair.torch_placement == "v":
        stage_ids = [rank, 2 * p - 1 - rank]
    else:
        stage_ids = [rank + k * p for k in range(v)]  # looped: stage s on rank s mod p
    modules = [build_stage(spec, split[s], seed=0, device="cpu") for s in stage_ids]
    stages = [
        pipelining.PipelineStage(mod, s, n, torch.device("cpu"))
        for mod, s in zip(modules, stage_ids, strict=True)
    ]
    tokens = BATCH * SEQ

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Summed per micro-batch, divided by the whole batch's tokens: the same as ours.
        return (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), reduction="sum"
            )
            / tokens
        )

    cls = getattr(pipelining, pair.torch)
    # The multi-stage schedules (ScheduleInterleavedZeroBubble among them) take a list
    # even for one stage per rank.
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    schedule = cls(stages if multi else stages[0], m, loss_fn=loss_fn, scale_grads=False)
    params = [q for mod in modules for q in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    first, last = 0 in stage_ids, n - 1 in stage_ids
    losses: list[torch.Tensor] = []

    def step(i: int) -> None:
        x, y = batch(i)
        losses.clear()
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, losses


def summed_loss(losses: list[torch.Tensor]) -> float:
    loss = torch.tensor([float(sum(float(t.detach()) for t in losses))])
    dist.all_reduce(loss)  # only the last stage's rank holds losses: the others add 0
    return float(loss)


def run_torch(spec: Any, pair: Pair, m: int, steps: int) -> dict[str, float]:
    step, losses = make_torch(spec, pair, m)
    per_step, cpu = timed_steps(step, steps)
    return {"step_s": per_step, "cpu_s": cpu, "loss": summed_loss(losses)}


def run_paired(
    spec: Any, pair: Pair, m: int, steps: int, early: bool, plain: bool = False
) -> dict[str, Any]:
    """Both pipelines in the same processes, one step of each in turn (the order swapped
    every step), each step timed between barriers on the slower rank. Drift in the
    machine's speed (other tenants, clocks) then falls on both sides alike within a
    second, and the per-step ratios give a confidence interval for the ratio.

    ``plain``: the other side is our own pipeline with every B whole (what early input
    gradients buy), not torch's."""
    ours_name, theirs = pair.ours, pair.torch_name
    ours, (pipe, last) = make_ours(spec, ours_name, m, early)
    if plain:
        them, (_, last_plain) = make_ours(spec, ours_name, m, early=False)
        theirs = f"{ours_name} (B whole)"
    else:
        them, losses = make_torch(spec, pair, m)
    ours(0)
    them(0)
    times = torch.zeros(2, steps, dtype=torch.float64)
    cpu = torch.zeros(2, steps, dtype=torch.float64)
    for i in range(steps):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            (ours, them)[side](1 + i)
            times[side, i] = time.perf_counter() - start
            cpu[side, i] = time.process_time() - cpu_start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)  # both ranks' CPU seconds: the work, without the waiting
    return {
        "m": m,
        "ours": ours_name,
        "label": pair.label,
        "early_grads": early,
        "split": [str(a) for row in pipe.schedule.actions for a in row if a.kind is Kind.I],
        "torch": theirs,
        "ours_s": times[0].tolist(),
        "torch_s": times[1].tolist(),
        "ours_cpu_s": cpu[0].tolist(),
        "torch_cpu_s": cpu[1].tolist(),
        "loss_ours": last[0].loss,
        "loss_torch": last_plain[0].loss if plain else summed_loss(losses),
    }


def ratio_interval(ours_s: list[float], torch_s: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the per-step ratios torch/ours (> 1: ours faster) and its 95%
    bootstrap interval (2,000 resamples of the steps, fixed seed)."""
    import math
    import random

    logs = [math.log(t / o) for o, t in zip(ours_s, torch_s, strict=True)]
    rng = random.Random(0)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(2000))
    return (
        math.exp(statistics.fmean(logs)),
        math.exp(means[int(0.025 * len(means))]),
        math.exp(means[int(0.975 * len(means)) - 1]),
    )


PAIRED_HEADER = (
    f"{'m':>3} {'ours':<17} {'tok/s':>7} | {'torch':<34} {'tok/s':>7} | "
    f"{'ratio':>5} {'95% interval':>13} | {'cpu ratio':>9} {'95% interval':>13} | "
    f"{'last loss ours/torch':>20}"
)


def format_paired(row: dict[str, Any]) -> str:
    ratio, lo, hi = ratio_interval(row["ours_s"], row["torch_s"])
    cpu, cpu_lo, cpu_hi = ratio_interval(row["ours_cpu_s"], row["torch_cpu_s"])
    tps_ours = BATCH * SEQ / statistics.median(row["ours_s"])
    tps_torch = BATCH * SEQ / statistics.median(row["torch_s"])
    return (
        f"{row['m']:>3} {row['ours']:<17} {tps_ours:>7.0f} | {row['torch']:<34} "
        f"{tps_torch:>7.0f} | {ratio:>5.3f} {lo:>6.3f}-{hi:<6.3f} | "
        f"{cpu:>9.3f} {cpu_lo:>6.3f}-{cpu_hi:<6.3f} | "
        f"{row['loss_ours']:>10.5f}/{row['loss_torch']:.5f}"
    )


def worker(args: argparse.Namespace) -> None:
    from pipetrain.models import get_model_config, model_spec

    torch.set_num_threads(1)
    if args.heap == "keep":
        # As the trainer's processes do (pipetrain.heap); one setting for the
        # whole process, so both sides run under it.
        from pipetrain.heap import keep_heap

        keep_heap()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    spec = model_spec(get_model_config(args.model))
    rows: list[dict[str, Any]] = []
    if args.paired:
        for m in args.microbatches:
            for pair in selected(args):
                release_memory()
                rows.append(
                    run_paired(
                        spec, pair, m, args.paired, not args.no_early_grads, args.against_plain
                    )
                )
                if dist.get_rank() == 0:
                    print(format_paired(rows[-1]), flush=True)
        if dist.get_rank() == 0 and args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        dist.destroy_process_group()
        return
    for m in args.microbatches:
        for pair in selected(args):
            ours, theirs = pair.ours, pair.torch_name
            samples: dict[str, list[dict[str, float]]] = {"ours": [], "torch": []}
            for _ in range(args.rounds):
                for side in ("ours", "torch"):
                    release_memory()
                    dist.barrier()
                    reset_peak_rss()
                    if side == "ours":
                        res = run_ours(spec, ours, m, args.steps, not args.no_early_grads)
                    else:
                        res = run_torch(spec, pair, m, args.steps)
                    rss = torch.tensor([peak_rss_mb()])
                    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
                    res["peak_rss_mb"] = float(rss)
                    samples[side].append(res)
            rows.append(
                {"m": m, "label": pair.label, "ours": ours, "torch": theirs, "samples": samples}
            )
            if dist.get_rank() == 0:
                print(format_row(rows[-1]), flush=True)
    if dist.get_rank() == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def selected(args: argparse.Namespace) -> list[Pair]:
    wanted = args.only or DEFAULT
    return [pair for pair in PAIRS if pair.label in wanted]


def med(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


HEADER = (
    f"{'m':>3} {'ours':<17} {'tok/s':>7} {'RSS MB':>7} {'cpu s':>6} | {'torch':<34} {'tok/s':>7} "
    f"{'RSS MB':>7} {'cpu s':>6} | {'ratio':>5} | {'step s':>6} {'span s':>6} {'sim s':>6} {'step/sim':>8} | {'bubble meas/sim':>15} | "
    f"{'last loss ours/torch':>20}"
)


def format_row(row: dict[str, Any]) -> str:
    ours, theirs = row["samples"]["ours"], row["samples"]["torch"]
    tps_ours = BATCH * SEQ / med(ours, "step_s")
    tps_torch = BATCH * SEQ / med(theirs, "step_s")
    step, span, sim = (
        med(ours, "measured_step_s"),
        med(ours, "measured_span_s"),
        med(ours, "simulated_s"),
    )
    return (
        f"{row['m']:>3} {row['ours']:<17} {tps_ours:>7.0f} {med(ours, 'peak_rss_mb'):>7.0f} "
        f"{med(ours, 'cpu_s'):>6.2f} | {row['torch']:<34} {tps_torch:>7.0f} {med(theirs, 'peak_rss_mb'):>7.0f} "
        f"{med(theirs, 'cpu_s'):>6.2f} | "
        f"{tps_ours / tps_torch:>5.2f} | {step:>6.3f} {span:>6.3f} {sim:>6.3f} {step / sim:>8.3f} | "
        f"{med(ours, 'bubble_measured'):>7.3f}/{med(ours, 'bubble_simulated'):.3f} | "
        f"{ours[-1]['loss']:>10.5f}/{theirs[-1]['loss']:.5f}"
    )


def launch(argv: list[str]) -> int:
    print(PAIRED_HEADER if "--paired" in argv else HEADER, flush=True)
    return spawn_pair(__file__, argv)


def spawn_pair(script: str, argv: list[str]) -> int:
    """Run ``script --worker argv`` as ranks 0 and 1 of a gloo group on this host, one
    thread each; the worse exit status."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen([sys.executable, script, "--worker", *argv], env=env))
    return max(proc.wait() for proc in procs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-default")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[pair.label for pair in PAIRS],
        help="these rows (default: the issue's four, " + ", ".join(DEFAULT) + ")",
    )
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per run (after one warm-up)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each pair")
    parser.add_argument("--json", default="", help="also write the raw samples here")
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="N",
        help="instead: N paired steps per row, ours and torch's in turn in the same processes",
    )
    parser.add_argument(
        "--heap",
        choices=("keep", "glibc"),
        default="keep",
        help="keep: fix glibc's heap thresholds in both processes, as `pipetrain train` "
        "does (pipetrain.heap); glibc: its own dynamic thresholds",
    )
    parser.add_argument(
        "--no-early-grads",
        action="store_true",
        help="our pipelines run every backward whole (build_pipeline(early_grads=False)); "
        "default: early input gradients, as build_pipeline and pipetrain train run them",
    )
    parser.add_argument(
        "--against-plain",
        action="store_true",
        help="with --paired: pair our pipeline with our own with every backward whole, not "
        "with torch's (what early input gradients buy)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        exit_rank(0)  # not through finalization: gloo's threads can abort it
    return launch([a for a in sys.argv[1:] if a != "--worker"])


if __name__ == "__main__":
    raise SystemExit(main())
