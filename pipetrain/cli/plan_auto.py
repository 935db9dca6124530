"""``pipetrain plan --auto`` and ``pipetrain train --auto``: search the layouts, print the
fastest that fit, write the winner as a config ``pipetrain train --config`` runs as is.

    pipetrain plan --auto --model llama-default --world-size 4 [--memory-limit 1GiB]
                   [--batch-size 32] [--seq-len 128] [--hardware cpu|a100|h100]
                   [--balance profile] [--top 5] [--out auto.toml]

The search is ``pipetrain.partition.auto`` (what is exact, what is pruned:
docs/plan_auto.md). Costs are estimated from FLOPs for ``--hardware`` (per process; on a
CPU the cores are shared by the processes), or measured on this machine with
``--balance profile`` (whole layers at tp 1; a tp rank's share scaled as the estimate
scales it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.plan_calibrate import add_calibrate_flags, calibrate_for, check_calibrate_flags
from pipetrain.cli.plan_profile import auto_costs
from pipetrain.cli.ranks import parse_size
from pipetrain.models.config import ModelConfig
from pipetrain.partition.auto import AutoPlan, AutoRequest, Hardware, Scored, search
from pipetrain.partition.balance import format_bytes
from pipetrain.partition.estimate import DEFAULT_FLOPS
from pipetrain.partition.layouts import CostsFor
from pipetrain.schedules.registry import get_spec

__all__ = [
    "HARDWARE",
    "add_auto_flags",
    "add_train_auto_flags",
    "auto_config",
    "auto_overrides",
    "hardware_for",
    "render",
    "run_auto",
]

# Per process. The CPU figure is DEFAULT_FLOPS's two cores shared by the processes; the
# GPUs' are a sustained fraction of their fp32/TF32 peak, NVLink inside a node for tp,
# InfiniBand between nodes for pp and dp.
HARDWARE: dict[str, Hardware] = {
    "cpu": Hardware("cpu", DEFAULT_FLOPS / 2, 5e-5, 1e-4, 2e9, 2e9, 4e9),
    "a100": Hardware("a100", 1.0e14, 2e-5, 1e-5, 2.5e10, 2.4e11, 1.5e12),
    "h100": Hardware("h100", 2.5e14, 2e-5, 1e-5, 5e10, 4.5e11, 2.5e12),
}


def add_auto_flags(p: argparse.ArgumentParser) -> None:
    """``plan``'s flags of the search (with --memory-limit, --batch-size, --seq-len)."""
    p.add_argument(
        "--auto",
        action="store_true",
        help="search schedule, chunks, pp x dp x tp (x ep: MoE), micro-batches, recomputation, early "
        "input gradients for --world-size processes; print the fastest that fit",
    )
    p.add_argument("--world-size", type=int, metavar="N", help="with --auto: processes in all")
    p.add_argument(
        "--hardware",
        choices=tuple(HARDWARE),
        default="cpu",
        help="with --auto: the device the estimated costs are for (default cpu)",
    )
    p.add_argument(
        "--top", type=int, default=5, metavar="K", help="with --auto: layouts shown (default 5)"
    )
    p.add_argument(
        "--out", metavar="FILE", help="with --auto: write the winner as a train config (TOML)"
    )
    add_calibrate_flags(p)
    _add_measure_flags(p)


def _add_measure_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="K",
        help="with --auto: train the K fastest layouts for --measure-steps steps each on this "
        "machine and keep the fastest measured one that fits (default 0: predict only)",
    )
    p.add_argument(
        "--measure-steps",
        type=int,
        default=6,
        metavar="S",
        help="with --measure: steps each candidate trains (the first is not timed; default 6)",
    )


def hardware_for(name: str, world_size: int) -> Hardware:
    """The preset; a CPU's cores are shared by the processes that run on it."""
    hw = HARDWARE[name]
    if name == "cpu":
        cores = os.cpu_count() or 1
        # DEFAULT_FLOPS is two cores' worth; the trainer gives each process cores / processes
        # threads, or one thread time-sliced with the others beyond the cores.
        hw = dataclasses.replace(
            hw, flops=DEFAULT_FLOPS / 2 * cores / world_size, shared_cores=float(cores)
        )
    return hw


def _check(args: argparse.Namespace, config: ModelConfig) -> int:
    if args.world_size is None:
        raise UsageError("--auto needs --world-size N, the number of processes to plan for")
    for flag, value in (("--world-size", args.world_size), ("--top", args.top)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    _check_measure(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    seq_len: int = args.seq_len if args.seq_len is not None else config.max_seq_len
    if not 1 <= seq_len <= config.max_seq_len:
        raise UsageError(
            f"--seq-len {seq_len} is outside 1..{config.max_seq_len} (the model's max_seq_len)"
        )
    if args.out is not None and args.set:
        # A train config names a preset; a changed preset would train another model.
        raise UsageError(
            "--out writes a train config, which names a model preset without --set changes: "
            "drop --set, or drop --out and pass the layout to pipetrain train yourself"
        )
    return seq_len


def _check_measure(args: argparse.Namespace) -> None:
    if args.measure < 0:
        raise UsageError(f"--measure must be >= 0 (candidates to train), got {args.measure}")
    if hasattr(args, "calibrate_steps"):  # plan's flags, not train's
        check_calibrate_flags(args)
    if args.measure_steps < 2:
        raise UsageError(
            f"--measure-steps must be >= 2 (the first step is not timed), got {args.measure_steps}"
        )


def _measured_winner(
    plan: AutoPlan,
    args: argparse.Namespace,
    model: str,
    replan: Callable[[float], AutoPlan],
    extra: Sequence[str] = (),
) -> tuple[Scored | None, list[dict[str, Any]]]:
    """The predicted winner, or with ``--measure K`` the fastest measured of the K fastest
    that fits; the runs measured (as JSON). Where none fits as measured, ``replan`` searches
    once more under the limit lowered by the most a candidate went beyond its prediction
    (``lowered_limit``) and its K fastest are measured; if none of those fits either, the
    predicted winner stands, said so."""
    if not args.measure or plan.winner is None:
        return plan.winner, []
    from pipetrain.cli.plan_measure import (
        best_measured,
        lowered_limit,
        measure_top,
        render_measured,
    )

    say, limit = _say(args), plan.request.memory_limit
    quiet = getattr(args, "json", False)  # with --json the runs are in its object

    def measured_of(candidates: Sequence[Scored]) -> list[Any]:
        done = measure_top(
            candidates, plan.request, auto_overrides, model=model, steps=args.measure_steps,
            say=say, extra=extra,
        )  # fmt: skip
        if not quiet:
            sys.stdout.write(render_measured(done, limit))
        return done

    measured = measured_of(plan.ranked[: args.measure])
    best = best_measured(measured, limit)
    lowered = lowered_limit(measured, limit) if best is None and limit is not None else None
    if lowered is not None:
        say(
            f"none fits as measured: planning again under {format_bytes(lowered)} (the limit "
            f"less the most a candidate's process held beyond its prediction)"
        )
        again = replan(lowered)
        if again.ranked:
            more = measured_of(again.ranked[: args.measure])
            measured += more
            best = best_measured(more, limit)
    if best is None and measured and not quiet:
        sys.stdout.write("the predicted winner is kept: lower --memory-limit, or add processes\n")
    return (best.scored if best is not None else plan.winner), [m.to_json() for m in measured]


def _replanner(
    config: ModelConfig, request: AutoRequest, costs_for: CostsFor, hw: Hardware
) -> Callable[[float], AutoPlan]:
    """The same search under another memory limit (``--measure``'s second plan)."""

    def replan(limit: float) -> AutoPlan:
        return search(config, dataclasses.replace(request, memory_limit=limit), costs_for, hw)

    return replan


def run_auto(args: argparse.Namespace, config: ModelConfig) -> int:
    """``plan --auto``: the table, the winner's reasons, and ``--out``'s config."""
    seq_len = _check(args, config)
    limit = parse_size(args.memory_limit) if args.memory_limit is not None else None
    hw = hardware_for(args.hardware, args.world_size)
    request = AutoRequest(
        args.world_size, args.batch_size, seq_len, limit, top=args.top, grad_views=True
    )
    profile = request if args.balance == "profile" else None
    costs_for, source, hw = auto_costs(args, config, seq_len, hw, profile)
    if profile is not None:
        costs_for, hw, said = calibrate_for(
            args, config, request, costs_for, hw, auto_overrides, say=_say(args)
        )
        source += said
    plan = search(config, request, costs_for, hw)
    if not args.json:
        sys.stdout.write(render(plan, config.name, source))
    replan = _replanner(config, request, costs_for, hw)
    winner, measured = _measured_winner(plan, args, config.name, replan)
    if args.out is not None and winner is not None:
        _write(Path(args.out), config.name, winner, request)
        _say(args)(f"wrote {args.out}: pipetrain train --config {args.out}")
    if args.json:
        out = {"model": config.name, "costs": source.lstrip("; "), **plan.to_json()}
        out["explain"] = explain(plan)
        out["measured"] = measured
        out["winner"] = winner.to_json() if winner is not None else None
        out["config"] = auto_overrides(winner, request) if winner is not None else None
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0 if winner is not None else 2


def _say(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines: to stdout, or to stderr where stdout is one JSON object."""
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout

    def say(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    return say


def auto_overrides(scored: Scored, request: AutoRequest) -> dict[str, Any]:
    """The config fields of a layout (``--set`` keys)."""
    lay = scored.layout
    fields = {
        "pipeline.schedule": lay.schedule,
        "pipeline.pp": lay.pp,
        "pipeline.dp": lay.dp,
        "pipeline.tp": lay.tp,
        "pipeline.ep": lay.ep,
        "pipeline.chunks": lay.chunks,
        "pipeline.microbatches": lay.microbatches,
        "pipeline.split": ",".join(str(n) for n in scored.split) if lay.pp > 1 else "",
        "pipeline.balance": "uniform",
        "pipeline.recompute": lay.recompute,
        "pipeline.recompute_ranks": ",".join(map(str, lay.recompute_ranks)),
        "pipeline.early_grads": lay.early_grads,
        "pipeline.grad_as_bucket_view": lay.grad_views,
        "data.batch_size": request.batch_size,
        "data.seq_len": request.seq_len,
    }
    if not get_spec(lay.schedule).uses_chunks:
        # A schedule with a fixed number of stages a rank (Chimera, the V schedules) takes
        # no chunks: train refuses any given for it, 1 included.
        del fields["pipeline.chunks"]
    return fields


def _write(path: Path, model: str, scored: Scored, request: AutoRequest) -> None:
    from pipetrain.config import load_config
    from pipetrain.config.load import config_to_toml

    overrides = {"model.name": model, **auto_overrides(scored, request)}
    config = load_config(None, overrides, check_paths=False)
    text = config_to_toml(config)
    if not get_spec(scored.layout.schedule).uses_chunks:
        # A chunks line is a request train checks against the schedule; one with a fixed
        # number of stages a rank (Chimera, the V schedules) accepts none but its own
        # default, which a line of 1 would contradict: leave the field out.
        text = text.replace("\nchunks = 1\n", "\n", 1)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(
            f"--out {path}: cannot write it ({exc.strerror}): give a writable path"
        ) from None


def _size(n: float) -> str:
    return format_bytes(n)


def render(plan: AutoPlan, model: str, source: str) -> str:
    """The top layouts as a table, then why the winner wins and what a budget took."""
    req = plan.request
    limit = "no limit" if req.memory_limit is None else f"{_size(req.memory_limit)} per process"
    lines = [
        f"{model} on {req.world_size} processes, batch {req.batch_size} x {req.seq_len}, {limit}",
        f"costs {source}",
        f"{'#':>2}  {'layout':<46} {'split':<18} {'step':>9} {'tokens/s':>10} {'bubble':>7} "
        f"{'peak/process':>13}",
    ]
    for i, s in enumerate(plan.ranked[: req.top], start=1):
        split = ",".join(map(str, s.split))
        lines.append(
            f"{i:>2}  {s.layout.describe():<46} {split[:18]:<18} {s.step_time * 1e3:>7.1f}ms "
            f"{s.tokens_per_s:>10,.0f} {s.bubble:>7.1%} {_size(s.peak_bytes):>13}"
        )
    lines.extend(explain(plan))
    lines.append(
        f"searched {plan.layouts} layouts in {plan.seconds:.1f} s: {plan.simulated} simulated, "
        f"{plan.pruned} pruned by their bounds (docs/plan_auto.md)"
    )
    return "\n".join(lines) + "\n"


def explain(plan: AutoPlan) -> list[str]:
    """Why the winner wins, and what the memory limit made it give up."""
    win = plan.winner
    if win is None:
        best = plan.over_budget[0] if plan.over_budget else None
        need = (
            f": the leanest simulated needs {_size(min(s.peak_bytes for s in plan.over_budget))}"
            if best
            else ""
        )
        return [
            f"no layout fits{need}; raise --memory-limit, add processes (--world-size), or "
            "use a smaller --batch-size or --seq-len"
        ]
    m = win.memory[win.peak_rank]
    lines = [
        f"winner: {win.layout.describe()}, split {','.join(map(str, win.split))}: "
        f"{win.step_time * 1e3:.1f} ms a step (pipeline {win.pipeline_time * 1e3:.1f}, dp "
        f"all-reduce {win.dp_time * 1e3:.1f}, update {win.update_time * 1e3:.1f}), peak "
        f"{_size(win.peak_bytes)} on rank {win.peak_rank} (state {_size(m.static)}, "
        f"activations {_size(m.activations)}, recompute {_size(m.transient)}, backward "
        f"{_size(m.in_backward)}, buffers {_size(m.buffers)})"
    ]
    if len(plan.ranked) > 1:
        second = plan.ranked[1]
        lines.append(
            f"  it wins over {second.layout.describe()} by "
            f"{second.step_time / win.step_time - 1:.1%} ({_differences(win, second)})"
        )
    given = plan.given_up
    if given is not None:
        lines.append(
            f"  the memory limit gave up {given.layout.describe()}: "
            f"{1 - given.step_time / win.step_time:.1%} faster a step, but "
            f"{_size(given.peak_bytes)} on rank {given.peak_rank} ({_differences(win, given)})"
        )
    return lines


def _differences(a: Scored, b: Scored) -> str:
    """What ``a`` does differently from ``b``, and the bubbles and peaks."""
    names = [
        f.name
        for f in dataclasses.fields(a.layout)
        if getattr(a.layout, f.name) != getattr(b.layout, f.name)
    ]
    said = ", ".join(f"{n} {getattr(a.layout, n)} vs {getattr(b.layout, n)}" for n in names)
    return (
        f"{said or 'split ' + ','.join(map(str, a.split))}; bubble {a.bubble:.1%} vs "
        f"{b.bubble:.1%}; peak {_size(a.peak_bytes)} vs {_size(b.peak_bytes)}"
    )


def add_train_auto_flags(p: argparse.ArgumentParser) -> None:
    """``train --auto``: plan the layout first, then train it."""
    p.add_argument(
        "--auto",
        action="store_true",
        help="choose schedule, chunks, pp x dp x tp (x ep: MoE), micro-batches, recomputation, early "
        "input gradients for --world-size processes (as plan --auto), then train that layout",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --auto: processes in all (default: the config's pp x dp x tp)",
    )
    p.add_argument(
        "--memory-limit", metavar="SIZE", help="with --auto: memory per process, e.g. 16GiB"
    )
    p.add_argument(
        "--hardware",
        choices=tuple(HARDWARE),
        default="cpu",
        help="with --auto: the device the estimated costs are for (default cpu)",
    )
    _add_measure_flags(p)


def auto_config(config: Any, args: argparse.Namespace) -> Any:
    """``config`` (a ``TrainConfig``) with the layout ``plan --auto`` chooses for it."""
    from pipetrain.models.config import get_model_config

    if not getattr(args, "auto", False):
        return config
    world = args.world_size if args.world_size is not None else config.pipeline.processes
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    _check_measure(args)
    limit = parse_size(args.memory_limit) if args.memory_limit is not None else None
    model = get_model_config(config.model.name)
    hw = hardware_for(args.hardware, world)
    costs_for, source, hw = auto_costs(args, model, config.data.seq_len, hw, None)
    request = AutoRequest(
        world, config.data.batch_size, config.data.seq_len, limit, grad_views=True
    )
    plan = search(model, request, costs_for, hw)
    sys.stdout.write(render(plan, model.name, source))
    if plan.winner is None:
        raise UsageError(
            f"--auto found no layout of {world} processes that fits: raise --memory-limit, "
            "add processes (--world-size), or use a smaller --batch-size or --seq-len"
        )
    # The candidates train on the run's data and device, not the defaults.
    extra = [
        text
        for key, value in (
            ("data.path", config.data.path),
            ("data.tokenizer", config.data.tokenizer),
            ("pipeline.device", config.pipeline.device),
            ("pipeline.precision", config.pipeline.precision),
        )
        for text in ("--set", f"{key}={json.dumps(value)}")
    ]
    replan = _replanner(model, request, costs_for, hw)
    winner = _measured_winner(plan, args, model.name, replan, extra)[0] or plan.winner
    fields = auto_overrides(winner, request)
    pipeline = {k.split(".", 1)[1]: v for k, v in fields.items() if k.startswith("pipeline.")}
    pipeline.setdefault("chunks", 1)  # the schedule's own number
    return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, **pipeline))
