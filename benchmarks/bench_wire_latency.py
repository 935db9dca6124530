"""How long a message between two ranks takes when its receiver already waits for it.

Runs one of our schedules on llama-default (the same set-up as ``bench_runtime.py``: 2
processes, one thread each, gloo, batch 32 x 128) and reads every action's start and end
on the host's monotonic clock, which both processes share. For each message whose RECV
started before its SEND did (the receiver was idle, waiting), the latency is the RECV's
end minus the SEND's start: what a transfer adds to the critical path. Per message of
the step (boundary and micro-batch), over the timed steps: the median and mean latency,
and how many steps had the receiver waiting. The first message of each boundary in a
step is the one whose payload the transport posts before its header is read only from the
second step on (``DistTransport``, the guess).

    .venv/bin/python benchmarks/bench_wire_latency.py [--schedule interleaved-1f1b]
        [--microbatches 4] [--steps 22]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_runtime import BATCH, SEQ, batch, spawn_pair

from pipetrain.schedules import Kind

MessageId = tuple[int, bool, int]  # (destination stage, is_grad, micro-batch)


def worker(args: argparse.Namespace) -> None:
    from pipetrain.heap import keep_heap
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.runtime import build_pipeline

    torch.set_num_threads(1)
    keep_heap()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    spec = model_spec(get_model_config("llama-default"))
    pipe = build_pipeline(
        spec,
        schedule=args.schedule,
        microbatches=args.microbatches,
        group=dist.group.WORLD,
        device="cpu",
        seed=0,
        chunks=args.chunks,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    # The executor's clock readings are absolute perf_counter_ns values (CLOCK_MONOTONIC on
    # Linux: one clock for every process of the host); they are read before the pipeline
    # makes them relative to its step's origin.
    executor = pipe._train[0]
    steps: list[list[tuple[Any, int, int]]] = []
    for i in range(args.steps):
        x, y = batch(i)
        pipe.step(x, y)
        opt.step()
        pipe.zero_grad()
        times = executor.clock.times
        steps.append(list(zip(executor.actions, times[0::2], times[1::2], strict=True)))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    if dist.get_rank() == 0:
        report(gathered, args)
    dist.destroy_process_group()


def report(per_rank: list[list[list[tuple[Any, int, int]]]], args: argparse.Namespace) -> None:
    latency: dict[MessageId, list[float]] = {}
    firsts: set[MessageId] = set()  # the first message of each boundary in the step
    first_steps = 2  # the first step has no guess, the second is the first with one
    for s in range(first_steps, args.steps):
        sends: dict[MessageId, int] = {}
        boundary_first: dict[tuple[int, bool], tuple[int, MessageId]] = {}
        recvs: dict[MessageId, int] = {}
        starts: dict[MessageId, int] = {}
        for rank_steps in per_rank:
            for action, start, end in rank_steps[s]:
                if action.kind in (Kind.SEND_F, Kind.SEND_B):
                    grad = action.kind is Kind.SEND_B
                    dst = action.stage - 1 if grad else action.stage + 1
                    key = (dst, grad, action.microbatch)
                    sends[key] = start
                    if boundary_first.get((dst, grad), (start + 1,))[0] > start:
                        boundary_first[(dst, grad)] = (start, key)
                elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                    key = (action.stage, action.kind is Kind.RECV_B, action.microbatch)
                    recvs[key], starts[key] = end, start
        firsts.update(key for _, key in boundary_first.values())
        for key, end in recvs.items():
            if starts[key] < sends[key]:  # the receiver was waiting when the send began
                latency.setdefault(key, []).append((end - sends[key]) / 1e6)
    print(
        f"{args.schedule}, m = {args.microbatches}, steps {first_steps + 1}-{args.steps} "
        f"(batch {BATCH} x {SEQ}): latency of a message whose receiver waited, ms"
    )
    print(f"{'message':<28} {'median':>7} {'mean':>7} {'max':>7} {'steps':>6}")
    first_values: list[float] = []
    later_values: list[float] = []
    for key in sorted(latency):
        dst, grad, mb = key
        values = latency[key]
        (first_values if key in firsts else later_values).extend(values)
        name = f"{'gradient' if grad else 'activations'} -> stage {dst}, mb {mb}"
        print(
            f"{name:<28} {statistics.median(values):>7.2f} {statistics.mean(values):>7.2f} "
            f"{max(values):>7.2f} {len(values):>6}"
        )
    for label, values in (("first of a boundary", first_values), ("later ones", later_values)):
        if values:
            print(
                f"{label}: mean {statistics.mean(values):.2f} ms, median "
                f"{statistics.median(values):.2f} ms over {len(values)} waits"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="interleaved-1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=None, help="stages per rank")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the first two steps are not counted")
    if args.worker:
        worker(args)
        return 0
    return spawn_pair(__file__, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
