"""``pipetrain plan``: where to cut a model for a schedule, what each rank holds, which micro-batch.

    pipetrain plan --model llama-default [--set n_layers=24] --pp 3 [--schedule 1f1b] [--chunks V]
                   [--tp 8 [--sequence-parallel] [--tp-bandwidth 1.5e11]]
                   [--ep 8 [--ep-bandwidth 5e10]]
                   [--split 4,3,5 | --balance uniform|params|profile]
                   [--batch-size 32] [--seq-len 128] [--microbatches 8]
                   [--memory-limit 16GiB] [--rank-speed 1,1,0.5,1] [--rank-memory 8GiB,...]
                   [--json]

Without ``--balance profile`` the times are estimated from FLOPs (and say so); with it
each layer is measured on this machine's device, which needs torch, imported only then.
With ``--tp`` every figure per rank is one tensor-parallel rank's (docs/memory_model.md),
with ``--ep`` one expert-parallel rank's (``pipetrain.cli.plan_moe``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.plan_auto import add_auto_flags, run_auto
from pipetrain.cli.plan_moe import add_ep_flags, check_ep_args, moe_report
from pipetrain.cli.plan_profile import profile_device
from pipetrain.cli.plan_text import TpReport, render
from pipetrain.cli.ranks import add_rank_flags, compare_equal, parse_size, rank_options
from pipetrain.models.config import ModelConfig, get_model_config, parse_overrides
from pipetrain.partition.balance import LayerCost, format_bytes, parse_split
from pipetrain.partition.estimate import DEFAULT_FLOPS, estimate_costs
from pipetrain.partition.overhead import remove_fixed_cost, split_fixed_cost
from pipetrain.partition.planner import Overheads, Plan, make_plan
from pipetrain.schedules.registry import SCHEDULE_NAMES, get_spec
from pipetrain.sim.tensor_parallel import MOE_TP, layer_collectives, tp_time, tp_traffic

__all__ = ["add_parser", "parse_size", "run"]

_FP32 = 4  # bytes of one number of the activations the planner counts


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="split a model into pipeline stages for a schedule; memory and micro-batch advice",
        description="Split a model into pipeline stages for a schedule and report, per stage, "
        "its rank, layers, parameters, time and activation memory; per rank the totals; and "
        "the micro-batch size and count to use.",
    )
    _add_split_flags(p)
    _add_batch_flags(p)
    add_rank_flags(p)
    _add_cost_flags(p)
    _add_tp_flags(p)
    add_ep_flags(p)
    _add_profile_flags(p)
    add_auto_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run)


def _add_split_flags(p: argparse.ArgumentParser) -> None:
    """The model, the pipeline and how to split the model over it."""
    p.add_argument(
        "--model", required=True, metavar="NAME", help="a preset, e.g. llama-default, llama3-8b"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="change a field of the model preset, e.g. --set n_layers=24 (repeatable)",
    )
    p.add_argument("--pp", type=int, metavar="P", help="pipeline ranks (or --auto)")
    p.add_argument(
        "--schedule",
        default="1f1b",
        metavar="NAME",
        help=f"the schedule the split is for (default 1f1b; one of {', '.join(SCHEDULE_NAMES)})",
    )
    p.add_argument("--chunks", type=int, metavar="V", help="stages per rank for looped schedules")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--split", metavar="4,3,5", help="blocks per stage; embedding first, head last"
    )
    how.add_argument(
        "--balance",
        choices=("uniform", "params", "profile"),
        default="uniform",
        help="even blocks, even parameters, or even measured time (default uniform)",
    )


def _add_batch_flags(p: argparse.ArgumentParser) -> None:
    """The batch, its micro-batches and the memory they must fit in."""
    p.add_argument(
        "--batch-size", type=int, default=32, metavar="B", help="sequences per step (default 32)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="T",
        help="tokens per sequence (default: the model's max_seq_len)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=8,
        metavar="M",
        help="micro-batches per step (default 8)",
    )
    p.add_argument(
        "--memory-limit", metavar="SIZE", help="memory per rank, e.g. 16GiB (default: no limit)"
    )


def _add_cost_flags(p: argparse.ArgumentParser) -> None:
    """What estimated layers and messages cost."""
    p.add_argument(
        "--flops",
        type=float,
        default=DEFAULT_FLOPS,
        metavar="FLOP/S",
        help=f"throughput assumed for estimated times (default {DEFAULT_FLOPS:.0e})",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        default=0.05,
        metavar="MS",
        help="fixed time per layer per forward or backward piece, any micro-batch size, for "
        "estimated costs (default 0.05; --balance profile measures it)",
    )
    p.add_argument(
        "--latency-ms", type=float, default=0.1, metavar="MS", help="time per message (default 0.1)"
    )


def _add_tp_flags(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism inside every stage: its degree and its link."""
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel ranks per stage (as train --tp): matrices, their gradients and "
        "optimizer state, and attention's and the MLP's activations split N ways; per-rank "
        "figures are one tp rank's (default 1)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: the norms' and the residual stream's activations split over the "
        "sequence too (as train --sequence-parallel)",
    )
    p.add_argument(
        "--tp-bandwidth",
        type=float,
        default=None,
        metavar="BYTES/S",
        help="bytes per second of a rank's tensor-parallel link: the tp all-reduces (2 per "
        "block forward, 2 backward) add their time to the layers (default: bytes only, no time)",
    )


def _add_profile_flags(p: argparse.ArgumentParser) -> None:
    """How --balance profile measures the layers."""
    p.add_argument(
        "--device",
        metavar="DEV",
        help="device to profile on (default: cuda if available, else cpu)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="CPU threads while profiling (default 1)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        metavar="N",
        help="timed runs per layer, fastest kept (default 5)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="weights and inputs of the profile (default 0)"
    )


def _check_args(args: argparse.Namespace, config: ModelConfig) -> int:
    for name in ("pp", "tp", "batch_size", "microbatches", "threads", "repeats"):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.chunks is not None and args.chunks < 1:
        raise UsageError(f"--chunks must be >= 1, got {args.chunks}")
    # NaN passes every comparison and inf makes every time 0 or inf: both print a plan of nan.
    for flag, value, zero_ok in (
        ("--flops", args.flops, False),
        ("--overhead-ms", args.overhead_ms, True),
        ("--latency-ms", args.latency_ms, True),
        ("--tp-bandwidth", 1.0 if args.tp_bandwidth is None else args.tp_bandwidth, False),
    ):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise UsageError(
                f"{flag} is {value}: give a finite number {'>=' if zero_ok else '>'} 0"
            )
    seq_len: int = args.seq_len if args.seq_len is not None else config.max_seq_len
    if not 1 <= seq_len <= config.max_seq_len:
        raise UsageError(
            f"--seq-len {seq_len} is outside 1..{config.max_seq_len} (the model's max_seq_len)"
        )
    if args.tp == 1 and (args.sequence_parallel or args.tp_bandwidth is not None):
        flag = "--sequence-parallel" if args.sequence_parallel else "--tp-bandwidth"
        raise UsageError(f"{flag} is for tensor parallelism: add --tp 2 (or more), or drop it")
    if args.tp > 1 and args.balance == "profile" and args.split is None:
        # The profile times whole layers on one device; a tp rank's share is not measured.
        raise UsageError(
            "--balance profile measures whole layers on one device, not a tp rank's share: "
            "use --balance uniform or params with --tp"
        )
    return seq_len


def _costs(
    args: argparse.Namespace, config: ModelConfig, seq_len: int
) -> tuple[Sequence[LayerCost], str, float]:
    """Per-layer costs, where they came from, and the fixed seconds per layer and action."""
    if args.balance != "profile" or args.split is not None:
        source = (
            f"estimated from FLOPs at {args.flops:.3g} FLOP/s plus {args.overhead_ms} ms per layer "
            "and action (use --balance profile to measure)"
        )
        if args.tp > 1:
            link = f"{args.tp_bandwidth:.3g} B/s" if args.tp_bandwidth else "no time (bytes only)"
            source += f"; tp {args.tp} collectives at {link}"
        if args.ep > 1:
            link = f"{args.ep_bandwidth:.3g} B/s" if args.ep_bandwidth else "no time (bytes only)"
            source += f"; ep {args.ep} all-to-alls at {link}"
        costs = estimate_costs(
            config,
            seq_len,
            flops_per_second=args.flops,
            tp=args.tp,
            sequence_parallel=args.sequence_parallel,
            tp_bandwidth=args.tp_bandwidth,
            ep=args.ep,
            ep_bandwidth=args.ep_bandwidth,
        )
        return costs, source, args.overhead_ms / 1e3
    import torch  # only a measured plan needs torch

    from pipetrain.models.spec import model_spec
    from pipetrain.partition.profile import (
        available_bytes,
        profile_bytes,
        profile_layers,
    )

    if args.batch_size % args.microbatches:
        raise UsageError(
            f"--batch-size {args.batch_size} is not a multiple of --microbatches {args.microbatches}"
        )
    mb = args.batch_size // args.microbatches
    device = profile_device(args)
    # A real size can need more than the machine has: refuse it before the kernel kills us.
    need, layer = profile_bytes(estimate_costs(config, seq_len), mb)
    free = available_bytes(device)
    if free is not None and need > free:
        raise UsageError(
            f"--balance profile needs about {format_bytes(need)} to measure layer {layer} at "
            f"micro-batch {mb} x {seq_len}, more than the {format_bytes(free)} free on {device}: "
            "use a smaller --seq-len or micro-batch (--batch-size / --microbatches), or estimated "
            "costs (--balance params)"
        )
    ids = torch.randint(
        0, config.vocab_size, (mb, seq_len), generator=torch.Generator().manual_seed(args.seed)
    )
    spec = model_spec(config)

    def measure(batch: torch.Tensor) -> list[LayerCost]:
        return profile_layers(
            spec, batch, seed=args.seed, device=device, threads=args.threads, repeats=args.repeats
        )

    costs = measure(ids)
    threads = f", {args.threads} thread(s)" if device.type == "cpu" else ""
    source = f"measured on {device}{threads} at micro-batch {mb} x {seq_len}"
    if mb == 1:
        # One size cannot separate the fixed part: take --overhead-ms out of the measurement.
        fixed = args.overhead_ms / 1e3
        source += f"; fixed part assumed {args.overhead_ms} ms per layer and action"
        return remove_fixed_cost(costs, 1, fixed), source, fixed
    # A second profile at one sample separates the per-call part from the per-sample part.
    fit = split_fixed_cost(measure(ids[:1]), 1, costs, mb)
    source += f" and 1; fixed part {fit.per_layer * 1e3:.3f} ms per layer and action"
    return fit.costs, source, fit.per_layer


def run(args: argparse.Namespace) -> int:
    config = get_model_config(args.model, **parse_overrides(args.set))
    if args.auto:
        return run_auto(args, config)
    if args.pp is None:
        raise UsageError("plan needs --pp P, or --auto --world-size N to search the layouts")
    seq_len = _check_args(args, config)
    check_ep_args(args, config)
    spec = get_spec(args.schedule)
    if args.chunks is not None and args.chunks > 1 and not spec.uses_chunks:
        # Ignoring it would plan one stage per rank for a user who asked for several.
        raise UsageError(
            f"--chunks {args.chunks} needs a schedule with several stages per rank "
            f"(interleaved-1f1b, looped-bfs); {args.schedule} has a fixed number: drop --chunks"
        )
    split = parse_split(args.split) if args.split is not None else None
    memory_limit = parse_size(args.memory_limit) if args.memory_limit is not None else None
    # Fail on the schedule's constraints before any profiling.
    problem = spec.check(args.pp, args.microbatches, args.chunks)
    if problem is not None:
        raise UsageError(problem)
    ranks = rank_options(args, args.pp)
    method = "explicit" if split is not None else args.balance
    costs, source, per_layer = _costs(args, config, seq_len)

    def plan_for(**split_and_ranks: Any) -> Plan:
        return make_plan(
            costs,
            schedule_for=lambda m: spec.build(args.pp, m, args.chunks),
            batch_size=args.batch_size,
            microbatches=args.microbatches,
            time_source=source,
            overheads=Overheads(
                per_layer=per_layer,
                latency=args.latency_ms / 1e3,
                # With sequence parallelism a tp rank sends its peer 1/tp of the sequence.
                message_bytes_per_sample=_FP32
                * seq_len
                * config.d_model
                / (args.tp if args.sequence_parallel else 1),
            ),
            whole_batch=spec.whole_batch,
            **split_and_ranks,
        )

    plan = plan_for(
        # An even count of blocks ignores speed and memory: balance by time for the ranks.
        method="cost" if ranks.given and method == "uniform" else method,
        split=split,
        memory_limit=memory_limit,
        rank_speed=ranks.speed,
        rank_memory=ranks.memory,
    )
    effect = compare_equal(plan_for, plan, ranks, method, split, costs) if ranks.given else None
    # Blocks per stage: what `pipetrain train --split` takes to train this split (a first
    # stage of the embedding alone, or a last of the head alone, is 0 blocks there).
    blocks = ",".join(
        str(sum(1 for i in stage if costs[i].kind == "block")) for stage in plan.partition.stages
    )
    moe_blocks = frozenset(f"layers.{b}" for b in config.moe_blocks)
    tp = _tp_report(args, plan, costs, seq_len * config.d_model * _FP32, moe_blocks)
    moe = moe_report(args, config, plan, costs, seq_len)
    if args.json:
        out = plan.to_json()
        out.update(model=config.name, seq_len=seq_len, train_split=blocks, **tp.to_json())
        if effect is not None:
            out["unequal_ranks"] = effect[1]
        if moe is not None:
            out["moe"] = moe.to_json()
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write(render(plan, config.name, seq_len, tp, moe))
        sys.stdout.write("".join(line + "\n" for line in (effect[0] if effect else [])))
        sys.stdout.write(f"to train this split: pipetrain train ... --split {blocks}\n")
    return 0


def _tp_report(
    args: argparse.Namespace,
    plan: Plan,
    costs: Sequence[LayerCost],
    activation: float,
    moe_blocks: frozenset[str] = frozenset(),
) -> TpReport:
    """Per pipeline rank, the bytes its tp collectives move through one tp rank's link per
    step, and their time; ``activation``: bytes of one sequence's (T, C) activation;
    ``moe_blocks``: the names of the blocks whose tp collectives are attention's only."""
    traffic = [0.0] * plan.pp
    time = [0.0] * plan.pp
    for stage in plan.stages:
        per_mb = sum(
            MOE_TP.total
            if costs[i].name in moe_blocks
            else layer_collectives(costs[i].kind, sequence_parallel=args.sequence_parallel).total
            for i in stage.layers
        )
        size = activation * plan.microbatch_size
        for rank in stage.ranks:  # a replica runs its share of the micro-batches
            count = per_mb * plan.microbatches / len(stage.ranks)
            traffic[rank] += tp_traffic(count, size, args.tp)
            time[rank] += tp_time(count, size, args.tp, args.tp_bandwidth)
    return TpReport(args.tp, args.sequence_parallel, args.tp_bandwidth, tuple(traffic), tuple(time))
