"""``pipetrain simulate --ep``: the expert-parallel all-to-alls of the MoE layers on every
F, B and I (``pipetrain.sim.expert_parallel``), and what they send per step."""

from __future__ import annotations

import argparse
import math
from typing import Any

from pipetrain.cli.errors import UsageError
from pipetrain.cli.simulate_cases import SimCase
from pipetrain.schedules.execution import Costs
from pipetrain.sim.costs import stage_share
from pipetrain.sim.expert_parallel import (
    ALLTOALLS_BACKWARD,
    ALLTOALLS_FORWARD,
    ep_sent,
    ep_time,
    with_ep_time,
)

__all__ = ["add_ep_flags", "ep_json", "ep_line", "with_expert_parallel"]


def add_ep_flags(p: argparse.ArgumentParser) -> None:
    """Expert parallelism in the MoE layers of each stage and its all-to-alls."""
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="expert-parallel ranks: every F, B and I waits for the all-to-alls of its MoE "
        "layers (2 forward, 2 backward each) of --ep-bytes at --ep-bandwidth (default 1: "
        "none). --weight-bytes is then one ep rank's, as pipetrain plan --ep prints it",
    )
    p.add_argument(
        "--ep-bytes",
        type=float,
        default=0.0,
        metavar="BYTES",
        help="bytes of the token vectors one micro-batch routes through one MoE layer "
        "(micro-batch x T x top_k x C x dtype); a rank sends (N-1)/N of them in each "
        "all-to-all (dropless, balanced routing) (default 0)",
    )
    p.add_argument(
        "--moe-layers",
        type=int,
        default=1,
        metavar="L",
        help="MoE layers in one rank's share of the model, split over its stages like "
        "--costs (default 1)",
    )
    p.add_argument(
        "--ep-bandwidth",
        type=float,
        default=None,
        metavar="BYTES",
        help="bytes per time unit of a rank's expert-parallel link (default: bytes only, no time)",
    )


def _check(args: argparse.Namespace) -> None:
    if args.ep < 1 or args.moe_layers < 1:
        flag, value = ("--ep", args.ep) if args.ep < 1 else ("--moe-layers", args.moe_layers)
        raise UsageError(f"{flag} {value}: give a whole number >= 1")
    if not 0 <= args.ep_bytes < math.inf:
        raise UsageError(f"--ep-bytes {args.ep_bytes}: give a finite number >= 0")
    if args.ep_bandwidth is not None and not 0 < args.ep_bandwidth < math.inf:
        raise UsageError(f"--ep-bandwidth {args.ep_bandwidth}: give a finite number > 0")
    given = [
        flag
        for flag, value, default in (
            ("--ep-bytes", args.ep_bytes, 0.0),
            ("--moe-layers", args.moe_layers, 1),
            ("--ep-bandwidth", args.ep_bandwidth, None),
        )
        if value != default
    ]
    if args.ep == 1 and given:
        verb = "needs" if len(given) == 1 else "need"
        raise UsageError(f"{' and '.join(given)} {verb} --ep 2 (or more): add --ep, or drop it")


def _per_alltoall(args: argparse.Namespace) -> float:
    """Bytes a rank sends in one all-to-all of all the MoE layers of its share."""
    layers: int = args.moe_layers
    return layers * ep_sent(args.ep_bytes, args.ep)


def with_expert_parallel(case: SimCase, costs: Costs, args: argparse.Namespace) -> Costs:
    """``costs`` with the all-to-alls' time on every F, B and I, with --ep above 1."""
    _check(args)
    if args.ep == 1:
        return costs
    # As many all-to-alls forward as backward: one time for F, and for B and I alike.
    seconds = ep_time(ALLTOALLS_FORWARD, _per_alltoall(args), args.ep_bandwidth)
    return with_ep_time(costs, seconds, stage_share(case.schedule))


def ep_json(case: SimCase, args: argparse.Namespace) -> dict[str, Any]:
    """Per micro-batch and per step, the time and bytes of a rank's all-to-alls."""
    per_layer = ep_sent(args.ep_bytes, args.ep)
    microbatches = case.schedule.microbatches * case.batch_scale
    alltoalls = ALLTOALLS_FORWARD + ALLTOALLS_BACKWARD
    return {
        "ep": args.ep,
        "ep_bytes": args.ep_bytes,
        "moe_layers": args.moe_layers,
        "time_per_forward": ep_time(ALLTOALLS_FORWARD, _per_alltoall(args), args.ep_bandwidth),
        "sent_per_layer_alltoall": per_layer,
        "sent_per_step": alltoalls * _per_alltoall(args) * microbatches,
    }


def ep_line(case: SimCase, args: argparse.Namespace) -> str:
    ep = ep_json(case, args)
    return (
        f"  ep={args.ep} all-to-alls  {ep['time_per_forward']:g} per F, B and I; each rank "
        f"sends {ep['sent_per_layer_alltoall']:g} bytes per MoE layer and all-to-all, "
        f"{ep['sent_per_step']:g} per step ({ALLTOALLS_FORWARD}+{ALLTOALLS_BACKWARD} "
        f"all-to-alls x {args.moe_layers} MoE layers x micro-batches)"
    )
