"""The hang doctor's cost on a healthy step: step times with its thread running and stopped.

One pipeline (``--model``, default llama-default; 1F1B on ``--pp`` local processes over
gloo, one thread each; batch 32 x 128 in 8 micro-batches, as ``pipetrain train``
defaults) steps in pairs, the doctor's thread (``HangWatch``: a heartbeat in the store
every 0.5 s) stopped for one step of the pair and running for the other, in the order
off-on, on-off, ... so that drift falls on both alike. The action clock it reads is the
runtime's own timeline, written whether or not a doctor runs: the thread is all there is
to switch. Rank 0 prints the median step time of each side and the median and 95%
bootstrap interval of the per-pair ratio on / off, and what the ring buffer's writes (two
clock readings stored per action, as the executor makes them) cost a step, timed alone.

    .venv/bin/python benchmarks/bench_doctor.py [--pp 3] [--pairs 16] [--model llama-default]
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import subprocess
import sys
import time

BATCH, SEQ, MICROBATCHES = 32, 128, 8


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from pipetrain.launch.process_exit import exit_rank
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    pipe = build_pipeline(
        model_spec(get_model_config(args.model)),
        schedule="1f1b",
        microbatches=MICROBATCHES,
        group=dist.group.WORLD,
        device=torch.device("cpu"),
        seed=0,
    )
    watch = pipe.hang_watch
    assert watch is not None
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)

    def step(on: bool) -> float:
        if on:
            watch.start()
        else:
            watch.stop(wait=True)
        dist.barrier()
        start = time.perf_counter()
        result = pipe.step(ids[:, :-1], ids[:, 1:])
        pipe.zero_grad()
        actions[0] = sum(1 for e in result.timeline.events if e.rank == dist.get_rank())
        return time.perf_counter() - start

    actions = [0]

    for _ in range(2):  # warm-up: allocations, first messages
        step(True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        for on in order:
            times[on].append(step(on))
    if dist.get_rank() == 0:
        ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
        rng = random.Random(0)
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(f"model {args.model}, 1f1b, pp {args.pp}, {args.pairs} pairs of steps")
        print(f"doctor off: median step {statistics.median(times[False]) * 1e3:.1f} ms")
        print(f"doctor on:  median step {statistics.median(times[True]) * 1e3:.1f} ms")
        print(
            f"on / off: median ratio {statistics.median(ratios):.4f} "
            f"(95% interval {boot[50]:.4f} - {boot[1949]:.4f})"
        )
        per_step = _ring_buffer_ns(actions[0])
        print(
            f"ring buffer: {actions[0]} actions on rank 0 a step, their (start, end) writes "
            f"{per_step / 1e3:.1f} us a step as the executor makes them (loop included) = "
            f"{per_step * 1e-9 / statistics.median(times[False]):.2e} of the median step"
        )
        sys.stdout.flush()
    exit_rank(0)


def _ring_buffer_ns(actions: int, repeats: int = 2000) -> float:
    """What the executor's ring buffer costs a step: two clock readings stored per action
    into a preallocated list (``RankExecutor.run``), timed over ``repeats`` steps' worth."""
    times = [0] * (2 * actions)
    clock = time.perf_counter_ns
    start = time.perf_counter_ns()
    for _ in range(repeats):
        for pos in range(actions):
            times[2 * pos] = clock()
            times[2 * pos + 1] = clock()
    return (time.perf_counter_ns() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--model", default="llama-default")
    args = parser.parse_args()
    if "RANK" in os.environ:
        _rank_main(args)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:]],
            env=dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(args.pp),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            ),
        )
        for r in range(args.pp)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
