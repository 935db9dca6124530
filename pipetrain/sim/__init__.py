"""Simulation of schedules and pictures of timelines. Imports no torch; matplotlib only
when a PNG or SVG is drawn."""

from pipetrain.sim.costs import CostsError, parse_costs, stage_costs
from pipetrain.sim.metrics import (
    Bubble,
    RankTimes,
    bubble,
    busy_time,
    live_activations,
    peak_activation_bytes,
    peak_activations,
    peak_with_gradients,
    rank_times,
    stage_weight_versions,
    weight_versions,
)
from pipetrain.sim.simulator import SimResult, SizeError, analyse, scale_costs, simulate

__all__ = [
    "Bubble",
    "CostsError",
    "RankTimes",
    "SimResult",
    "SizeError",
    "analyse",
    "bubble",
    "busy_time",
    "live_activations",
    "parse_costs",
    "peak_activation_bytes",
    "peak_activations",
    "peak_with_gradients",
    "rank_times",
    "scale_costs",
    "simulate",
    "stage_costs",
    "stage_weight_versions",
    "weight_versions",
]
