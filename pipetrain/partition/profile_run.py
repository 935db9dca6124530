"""Profile the layers at several micro-batch sizes, on as many processes as the run has.

On a CPU the run's processes share the cores and the memory bandwidth: a layer profiled
alone runs faster than it will in the run (measured here: 10-15% at two processes on two
cores; time-slicing doubles it at four). So on a CPU the profile runs in ``processes``
spawned processes at once, each with the threads the trainer will give it, which start
each size together (a barrier) and measure the same layers; each figure is the median
over the processes. On a GPU each process of the run has its own device, so one process
profiles alone.
"""

from __future__ import annotations

import multiprocessing
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost
from pipetrain.partition.cost_curve import CostCurve

__all__ = ["profile_curve"]

_TIMES = ("forward", "backward", "backward_input", "backward_weight")
# Seconds a spawned profile may take to import torch and measure every size.
_TIMEOUT_S = 900.0


def _measure_sizes(
    config: ModelConfig,
    seq_len: int,
    sizes: Sequence[int],
    device: str,
    threads: int,
    repeats: int,
    seed: int,
    *,
    barrier: Any = None,
) -> dict[int, list[LayerCost]]:
    from pipetrain.models.spec import model_spec
    from pipetrain.partition.profile import profile_layers

    spec = model_spec(config)
    ids = torch.randint(
        0, config.vocab_size, (max(sizes), seq_len), generator=torch.Generator().manual_seed(seed)
    )
    out = {}
    for size in sizes:
        if barrier is not None:
            barrier.wait(timeout=_TIMEOUT_S)
        out[size] = profile_layers(
            spec, ids[:size], seed=seed, device=device, threads=threads, repeats=repeats
        )
    return out


def _child(queue: Any, barrier: Any, args: tuple[Any, ...]) -> None:
    try:
        queue.put(("ok", _measure_sizes(*args, barrier=barrier)))
    except BaseException as exc:  # reported by the parent, which names the profile
        barrier.abort()
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def _median_costs(runs: Sequence[Sequence[LayerCost]]) -> list[LayerCost]:
    out = []
    for layers in zip(*runs, strict=True):
        times = {name: statistics.median(getattr(c, name) for c in layers) for name in _TIMES}
        out.append(replace(layers[0], **times))
    return out


def profile_curve(
    config: ModelConfig,
    seq_len: int,
    sizes: Sequence[int],
    *,
    processes: int,
    device: torch.device,
    threads: int,
    repeats: int = 3,
    seed: int = 0,
) -> CostCurve:
    """Per-sample layer costs at each of ``sizes``; on a CPU measured by ``processes``
    processes at once (see the module doc)."""
    sizes = sorted(set(sizes))
    args = (config, seq_len, sizes, str(device), threads, repeats, seed)
    if device.type != "cpu" or processes <= 1:
        return CostCurve(_measure_sizes(*args))
    ctx = multiprocessing.get_context("spawn")  # a forked torch can hang in its thread pools
    queue = ctx.Queue()
    barrier = ctx.Barrier(processes)
    children = [ctx.Process(target=_child, args=(queue, barrier, args)) for _ in range(processes)]
    for child in children:
        child.start()
    try:
        results = [queue.get(timeout=_TIMEOUT_S) for _ in children]
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [text for status, text in results if status == "error"]
    if errors:
        raise RuntimeError(f"the profile failed in a spawned process: {errors[0]}")
    return CostCurve({size: _median_costs([r[size] for _, r in results]) for size in sizes})
