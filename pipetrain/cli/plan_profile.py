"""Measure layer costs for ``plan``: the device to time them on, and ``plan --auto``'s
profile at every micro-batch size its search reads (``pipetrain.partition.profile_run``).

torch is imported only here, and only when a profile is asked for.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipetrain.cli.errors import UsageError
from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import format_bytes
from pipetrain.partition.cost_curve import CostCurve
from pipetrain.partition.estimate import estimate_costs

if TYPE_CHECKING:
    from pipetrain.partition.profile_run import Links

__all__ = ["auto_curve", "profile_device"]


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
    args: argparse.Namespace, config: ModelConfig, seq_len: int, sizes: Sequence[int]
) -> tuple[CostCurve, Links | None, str]:
    """Layer costs measured at each micro-batch size of ``sizes`` that this machine can
    hold (the others are read off the curve), the links between the processes where they
    profiled together, and a line saying how all was measured."""
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
    curve, links = profile_curve(
        config,
        seq_len,
        fits,
        processes=processes,
        device=device,
        threads=threads,
        repeats=args.repeats,
        seed=args.seed,
    )
    how = f", {processes} processes at once, {threads} thread(s) each" if processes > 1 else ""
    sizes_text = ",".join(map(str, fits))
    left = sorted(set(sizes) - set(fits))
    skipped = f" (sizes {','.join(map(str, left))} read off the curve)" if left else ""
    said = f"measured on {device} at micro-batch {sizes_text} x {seq_len}{how}{skipped}"
    if links is not None:
        reduces = "; ".join(
            f"{g} ranks {lat * 1e3:.2f} ms + {bw / 1e9:.2f} GB/s" for g, lat, bw in links.allreduce
        )
        said += (
            f"; links measured: send/recv {links.p2p_latency * 1e3:.2f} ms + "
            f"{links.p2p_bandwidth / 1e9:.2f} GB/s, all-reduce {reduces} (ring terms)"
        )
    return curve, links, said
