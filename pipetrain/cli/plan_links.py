"""The calibration's data-parallel all-reduce: refitted to the waits its references measured.

The profile times all-reduces between idle processes (``profile_run``), but in a run the
replicas of a step do not finish their backwards together where processes share the cores:
each waits, after its pipeline, for the slowest one and then for the reduction. A run
reports that wait (``dp_wait_s``: per pipeline rank, the mean over the steps after the first
and the replicas). Subtracting only the modelled reduction from a reference's step put the
rest of the wait into the compute of every layer, so the layouts without replicas were
predicted slower than they ran (docs/plan_auto.md, "The replicas' wait", has the figures). Each
reference with replicas sets the all-reduce's bandwidth at its group size so that its
modelled reduction meets its measured wait (the latency kept), and the compute is fitted on
what is left of its step. Torch-free.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from pipetrain.cli.plan_action_cost import Reference
from pipetrain.partition.layouts import Hardware

__all__ = ["refit_allreduce"]


def _scale(ref: Reference, latency: float) -> float | None:
    """The factor on the ring part of the reference's modelled reduction that makes it its
    measured wait; None where it has no replicas, no measured wait, or nothing to scale."""
    layout = ref.predicted.layout
    if layout.dp < 2 or ref.dp_wait is None:
        return None
    fixed = latency * layout.chunks  # one all-reduce call a stage of the rank
    ring = ref.predicted.dp_time - fixed
    if ring <= 0 or ref.dp_wait <= fixed:
        return None
    return (ref.dp_wait - fixed) / ring


def refit_allreduce(hw: Hardware, references: Sequence[Reference]) -> tuple[Hardware, str]:
    """``hw`` with the all-reduce at each group size that a reference with replicas ran at
    (the median over such references) slowed or sped so that the references' modelled
    reductions meet their measured waits, and a line saying so ("" where none did). Only
    where the profile measured the links (``hw.allreduce``): the preset's single bandwidth
    is not per group size."""
    if not hw.allreduce:
        return hw, ""
    scales: dict[int, list[float]] = {}
    for ref in references:
        group = ref.predicted.layout.dp
        scale = _scale(ref, hw.allreduce_link(group)[0])
        if scale is not None:
            scales.setdefault(group, []).append(scale)
    if not scales:
        return hw, ""
    table = {size: (latency, bandwidth) for size, latency, bandwidth in hw.allreduce}
    said = []
    for group, found in sorted(scales.items()):
        latency, bandwidth = hw.allreduce_link(group)
        scale = statistics.median(found)
        table[group] = (latency, bandwidth / scale)
        said.append(
            f"{group} ranks {bandwidth / scale / 1e9:.2f} GB/s (measured waits {scale:.2f}x "
            f"the profile's {bandwidth / 1e9:.2f} GB/s)"
        )
    links = tuple((size, lat, bw) for size, (lat, bw) in sorted(table.items()))
    return dataclasses.replace(hw, allreduce=links), (
        "; the dp all-reduce refitted to the replicas' waits: " + ", ".join(said)
    )
