"""Measure layer costs for ``plan``: the device to time them on, and ``plan --auto``'s
costs: estimated, or profiled at every micro-batch size its search reads with the links
and a step's memory (``pipetrain.partition.profile_run``).

torch is imported only here, and only when a profile is asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pipetrain.cli.errors import UsageError
from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost, format_bytes
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layer_costs import scaled_times
from pipetrain.partition.layouts import AutoRequest, CostsFor, Hardware, enumerate_layouts
from pipetrain.partition.memory import fit_overhead, recompute_costs
from pipetrain.partition.workspace import backward_workspace_bytes
from pipetrain.sim.tensor_parallel import layer_collectives, tp_time

if TYPE_CHECKING:
    from pipetrain.partition.profile_run import Profile

__all__ = [
    "auto_costs",
    "auto_curve",
    "profile_device",
    "ratio_at",
    "scaled_to_ratio",
    "tp_ratio_said",
    "tp_sizes_to_time",
]


def profile_device(args: argparse.Namespace) -> Any:
    """The torch device ``--balance profile`` times layers on, checked usable."""
    import torch

    from pipetrain.partition.profile import default_device

    try:
        device = torch.device(args.device) if args.device else default_device()
    except RuntimeError:
        raise UsageError(
            f"--device {args.device!r} is not a device: use cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device {args.device} but this machine has no CUDA device: use --device cpu"
        )
    if device.type == "meta":
        # Meta tensors have shapes but no data: every "measured" time would be noise.
        raise UsageError("--device meta runs no kernels, so it cannot time layers: use cpu or cuda")
    try:
        torch.zeros(1, device=device)
    except Exception as exc:  # torch raises RuntimeError, AssertionError or ImportError here
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0].split(". ")[0]
        raise UsageError(
            f"--device {args.device} cannot be used on this machine ({first_line}): use cpu or cuda"
        ) from None
    return device


def auto_curve(
    args: argparse.Namespace,
    config: ModelConfig,
    seq_len: int,
    sizes: Sequence[int],
    tp_sizes: Mapping[int, Sequence[int]] | None = None,
) -> tuple[Profile, str]:
    """Layer costs measured at each micro-batch size of ``sizes`` that this machine can
    hold (the others are read off the curve), the links between the processes where they
    profiled together, a step's bytes, tp steps over the unsharded step at ``tp_sizes``
    (tp degree -> sizes) where the processes can share them, and a line saying how all
    was measured."""
    from pipetrain.partition.profile import available_bytes, profile_bytes
    from pipetrain.partition.profile_run import profile_curve

    device = profile_device(args)
    cores = os.cpu_count() or 1
    # As the run: on a CPU every process at once, with cores / processes threads each.
    processes = args.world_size if device.type == "cpu" else 1
    threads = max(1, cores // args.world_size)
    estimate = estimate_costs(config, seq_len)
    free = available_bytes(device)
    fits = [
        s for s in sorted(set(sizes))
        if free is None or profile_bytes(estimate, s)[0] * processes <= free
    ]  # fmt: skip
    if not fits:
        need, layer = profile_bytes(estimate, min(sizes))
        raise UsageError(
            f"--balance profile needs about {format_bytes(need * processes)} to measure layer "
            f"{layer} at micro-batch {min(sizes)} x {seq_len}, more than the "
            f"{format_bytes(free or 0)} free on {device}: use a smaller --seq-len or "
            "estimated costs (drop --balance profile)"
        )
    profile = profile_curve(
        config,
        seq_len,
        fits,
        processes=processes,
        device=device,
        threads=threads,
        repeats=args.repeats,
        seed=args.seed,
        tp_sizes={t: [s for s in ss if s in fits] for t, ss in (tp_sizes or {}).items()},
    )
    how = f", {processes} processes at once, {threads} thread(s) each" if processes > 1 else ""
    sizes_text = ",".join(map(str, fits))
    left = sorted(set(sizes) - set(fits))
    skipped = f" (sizes {','.join(map(str, left))} read off the curve)" if left else ""
    said = f"measured on {device} at micro-batch {sizes_text} x {seq_len}{how}{skipped}"
    # The curve's shape, which one calibration size cannot correct, shown for checking:
    # a sample's forward and backward through every layer at each measured size.
    per_sample = ", ".join(f"{sum(c.time for c in profile.curve.at(s)) * 1e3:.1f}" for s in fits)
    said += f"; the whole model {per_sample} ms a sample"
    links = profile.links
    if links is not None:
        reduces = "; ".join(
            f"{g} ranks {lat * 1e3:.2f} ms + {bw / 1e9:.2f} GB/s" for g, lat, bw in links.allreduce
        )
        said += (
            f"; links measured: send/recv {links.p2p_latency * 1e3:.2f} ms + "
            f"{links.p2p_bandwidth / 1e9:.2f} GB/s, all-reduce {reduces} (ring terms)"
        )
    return profile, said + tp_ratio_said(profile.tp_ratio)


def tp_ratio_said(tp_ratio: Mapping[tuple[int, int], float]) -> str:
    """The source line's part for the tp steps measured: the ratio at each size."""
    parts = []
    for t in sorted({t for t, _ in tp_ratio}):
        got = sorted((s, r) for (d, s), r in tp_ratio.items() if d == t)
        (first, ratio), rest = got[0], got[1:]
        more = "".join(f", {r:.2f}x at {s}" for s, r in rest)
        parts.append(
            f"; tp {t} measured: a step {ratio:.2f}x the tp 1 step at micro-batch {first}{more}"
        )
    return "".join(parts)


def ratio_at(tp_ratio: Mapping[tuple[int, int], float], tp: int, mb: int) -> float | None:
    """The measured tp step ratio for ``tp`` at ``mb``: read off the line between the
    measured sizes either side of it in log size (the ratio falls about evenly per
    doubling of the micro-batch here), the nearest end's beyond them; None where that
    degree was not measured."""
    sizes = sorted(s for t, s in tp_ratio if t == tp)
    if not sizes:
        return None
    if mb <= sizes[0] or mb >= sizes[-1]:
        return tp_ratio[(tp, sizes[0] if mb <= sizes[0] else sizes[-1])]
    hi = next(s for s in sizes if s >= mb)
    lo = max(s for s in sizes if s <= mb)
    if hi == lo:
        return tp_ratio[(tp, lo)]
    at = (math.log(mb) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return tp_ratio[(tp, lo)] + at * (tp_ratio[(tp, hi)] - tp_ratio[(tp, lo)])


def tp_sizes_to_time(sizes: Iterable[int]) -> list[int]:
    """The micro-batch sizes whose tp step is timed, of those a degree's layouts run: the
    smallest, the largest and the one nearest their geometric middle (each size timed
    sharded and unsharded, a profile's largest cost on a wide model; ``ratio_at`` reads
    the others off the line)."""
    ordered = sorted(set(sizes))
    if len(ordered) <= 3:
        return ordered
    middle = math.sqrt(ordered[0] * ordered[-1])
    inner = min(ordered[1:-1], key=lambda s: (abs(math.log(s / middle)), s))
    return [ordered[0], inner, ordered[-1]]


def scaled_to_ratio(
    layers: Sequence[LayerCost], tp1: Sequence[LayerCost], ratio: float
) -> list[LayerCost]:
    """``layers`` (one tp rank's estimate) scaled by one factor so that their forward and
    backward per sample sum to ``ratio`` times ``tp1``'s: the measured step ratio sets the
    total, the estimate keeps how it is spread over the layers."""
    have = sum(c.forward + c.backward for c in layers)
    want = ratio * sum(c.forward + c.backward for c in tp1)
    if have <= 0 or want <= 0:
        return list(layers)
    return scaled_times(layers, want / have)


def auto_costs(
    args: argparse.Namespace,
    config: ModelConfig,
    seq_len: int,
    hw: Hardware,
    profile: AutoRequest | None,
) -> tuple[CostsFor, str, Hardware]:
    """(tp degree, micro-batch size) -> one tp rank's per-sample layer costs; where they
    came from; the hardware they go with. ``profile``: measure on this machine at every
    micro-batch size of that request's space (``--balance profile``), else estimate."""

    def estimated(tp: int, mb: int = 1) -> list[LayerCost]:
        return estimate_costs(
            config,
            seq_len,
            flops_per_second=hw.flops,
            tp=tp,
            tp_bandwidth=hw.tp_bandwidth if tp > 1 else None,
        )

    if profile is None:
        return (
            estimated,
            f"estimated from FLOPs for {hw.name} at {hw.flops:.3g} FLOP/s a process",
            hw,
        )
    sizes, tp_sizes = _sizes_to_profile(config, profile)
    measured, source = auto_curve(args, config, seq_len, sizes, tp_sizes)
    tp_ratio = measured.tp_ratio
    curve, links = measured.curve, measured.links
    if links is not None:
        hw = dataclasses.replace(
            hw,
            latency=links.p2p_latency,
            link_bandwidth=links.p2p_bandwidth,
            allreduce=links.allreduce,
            overlap_comm=False,  # links measured here: the processes share this machine's cores
        )
    else:  # profiled in one process: each of the run's processes has a device of its own
        hw = dataclasses.replace(hw, shared_cores=0.0)
    hw, source = _memory_fitted(config, seq_len, measured, hw, source)
    base = estimated(1)
    message = float(seq_len * config.d_model * 4)  # one sample's (T, d) activation, fp32

    def scaled(tp: int, mb: int) -> list[LayerCost]:
        measured = curve.at(mb)
        if tp == 1:
            return measured
        # A tp rank's share of a measured layer's compute as the estimate shrinks it, plus
        # its all-reduces at the measured (or the preset's) link, latency per call.
        latency, bandwidth = hw.allreduce_link(tp, tp=True)
        plain = estimate_costs(config, seq_len, flops_per_second=hw.flops, tp=tp)
        out = []
        for m, b, t in zip(measured, base, plain, strict=True):
            ratio = t.time / b.time if b.time > 0 else 1.0
            comm = layer_collectives(t.kind)
            c_fwd = tp_time(comm.forward, message, tp, bandwidth) + latency * comm.forward / mb
            c_in = tp_time(comm.backward, message, tp, bandwidth) + latency * comm.backward / mb
            out.append(
                dataclasses.replace(
                    t,
                    forward=m.forward * ratio + c_fwd,
                    backward=m.backward * ratio + c_in,
                    backward_input=m.backward_input * ratio + c_in,
                    backward_weight=m.backward_weight * ratio,
                )
            )
        # Where a sharded step was timed (profile_tp), its ratio to the unsharded step
        # sets the total: DTensor on gloo measured 2.4x the estimate on a CPU.
        step_ratio = ratio_at(tp_ratio, tp, mb)
        return out if step_ratio is None else scaled_to_ratio(out, measured, step_ratio)

    # The curve's per-sample figures hold the per-call part: no fixed cost on top.
    return scaled, source, dataclasses.replace(hw, per_layer=0.0)


def _sizes_to_profile(
    config: ModelConfig, profile: AutoRequest
) -> tuple[list[int], dict[int, list[int]]]:
    """The micro-batch sizes the request's layouts run, and per tp degree the sizes at
    which its sharded step is timed."""
    sizes: set[int] = set()
    tp_sizes: dict[int, set[int]] = {}  # tp degree -> the sizes its layouts run
    for lay in enumerate_layouts(config, profile):
        size = profile.batch_size // lay.dp // lay.microbatches
        sizes.add(size)
        if lay.tp > 1:
            tp_sizes.setdefault(lay.tp, set()).add(size)
    return sorted(sizes), {t: tp_sizes_to_time(s) for t, s in tp_sizes.items()}


def _memory_fitted(
    config: ModelConfig, seq_len: int, measured: Profile, hw: Hardware, source: str
) -> tuple[Hardware, str]:
    """``hw`` with what a measured step held beyond the model's count (plain and
    recomputing), and the source line saying so."""
    curve = measured.curve
    layers = curve.at(curve.sizes[0])
    # A one-process step runs its backwards whole (1F1B at pp=1).
    running = max(backward_workspace_bytes(config, seq_len).values())
    overhead = fit_overhead(
        measured.step_bytes,
        sum(c.activation_bytes_per_sample for c in layers),
        sum(c.param_bytes - c.tied_param_bytes for c in layers),
        running,
    )
    # Recomputing, a step keeps each block's input and re-runs one block's forward.
    kept = recompute_costs(layers, float(4 * seq_len * config.d_model))
    block = max((c.activation_bytes_per_sample for c in layers if c.kind == "block"), default=0.0)
    recomputed = fit_overhead(
        measured.recompute_step_bytes,
        sum(c.activation_bytes_per_sample for c in kept) + block,
        sum(c.param_bytes - c.tied_param_bytes for c in layers),
        running,
    )
    if overhead == (0.0, 0.0) and recomputed == (0.0, 0.0):
        return hw, source
    hw = dataclasses.replace(hw, memory_overhead=overhead, recompute_overhead=recomputed)
    return hw, source + (
        f"; a step's memory measured: {overhead[0]:.0%} of the activations and "
        f"{format_bytes(overhead[1])} a process beyond the model's count "
        f"({recomputed[0]:.0%} and {format_bytes(recomputed[1])} recomputing)"
    )
