"""Simulation of schedules and pictures of timelines. Imports no torch; matplotlib only
when a PNG or SVG is drawn."""

from pipetrain.sim.metrics import (
    Bubble,
    RankTimes,
    bubble,
    busy_time,
    live_activations,
    peak_activation_bytes,
    peak_activations,
    rank_times,
    stage_weight_versions,
    weight_versions,
)

__all__ = [
    "Bubble",
    "RankTimes",
    "bubble",
    "busy_time",
    "live_activations",
    "peak_activation_bytes",
    "peak_activations",
    "rank_times",
    "stage_weight_versions",
    "weight_versions",
]
