"""Time tensor parallelism for real in ``plan --auto --balance profile``'s processes.

The planner's tp layer costs shrink each measured layer by the FLOP estimate's ratio and
add the modelled all-reduces; on a CPU with gloo a real tp step (DTensor, as
``pipeline.tp`` runs it) measured 2.4x that prediction (llama-default, 4 processes, 1f1b
pp=2 tp=2 m=4: 1175 ms predicted, 2809 ms measured), so tp layouts topped the ranking
wrongly. Here the trainer's one-stage pipeline takes a whole step sharded over ``t``
consecutive ranks, every group at once as in a run, and the same pipeline unsharded in
the same processes at the same size: the planner scales its tp layers to the ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["tp_step_ratios"]

# Untimed steps first (the first allocates and, sharded, sets up DTensor's dispatch), then
# at least this many timed, the median kept: a whole step varies more than one layer.
_WARMUP = 1
_MIN_TIMED = 3


def _median_step(step: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``step``, each started together with the other processes."""
    import torch.distributed as dist

    for _ in range(_WARMUP):
        step()
    samples = []
    for _ in range(max(repeats, _MIN_TIMED)):
        dist.barrier()
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _agreed(ok: bool) -> bool:
    """True where every process succeeded: one that failed must not leave the others
    timing a (t, size) alone, nor waiting in a collective it never joins."""
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _divides(config: Any, t: int) -> bool:
    from pipetrain.parallel.tp import TensorParallelError, check_model_divisible

    try:
        check_model_divisible(config, t)
    except TensorParallelError:
        return False
    return True


def _step_time(
    spec: Any, x: torch.Tensor, targets: torch.Tensor, dev: Any, seed: int, repeats: int,
    tp_mesh: Any = None,
) -> float | None:  # fmt: skip
    """Median seconds of the one-stage pipeline's step (forward, loss, backward) on this
    micro-batch, sharded over ``tp_mesh`` where given; None where it fails here."""
    from pipetrain.parallel.tp import shard_pipeline
    from pipetrain.runtime import build_pipeline

    try:
        pipeline = build_pipeline(
            spec, schedule="1f1b", microbatches=1, ranks=1, device=dev, seed=seed
        )
        if tp_mesh is not None:
            shard_pipeline(pipeline, tp_mesh)

        def step() -> None:
            pipeline.step(x, targets)
            pipeline.zero_grad()

        return _median_step(step, repeats)
    except (RuntimeError, MemoryError, ValueError):  # shapes, memory: the estimate stays
        return None


def tp_step_ratios(
    config: Any,
    spec: Any,
    ids: torch.Tensor,
    device: str,
    threads: int,
    repeats: int,
    seed: int,
    tp_sizes: Mapping[int, Sequence[int]],
) -> dict[tuple[int, int], float]:
    """(t, size) -> a step sharded over t ranks over the unsharded step, both timed in
    these processes at once at micro-batch ``size`` (``ids`` holds at least ``size`` rows).
    Every process of the group must call it with the same arguments. A (t, size) that
    fails in any process is left out (the planner keeps its estimate there)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dev = torch.device(device)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    targets_all = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(seed))
    out: dict[tuple[int, int], float] = {}
    try:
        for t in sorted(tp_sizes):
            if t <= 1 or world % t or not _divides(config, t):
                continue
            # Consecutive ranks share a tp group, as the trainer's mesh makes them.
            mesh = init_device_mesh(dev.type, (world // t, t), mesh_dim_names=("dp", "tp"))["tp"]
            for size in sorted(set(tp_sizes[t])):
                x, targets = ids[:size].to(dev), targets_all[:size].to(dev)
                plain = _step_time(spec, x, targets, dev, seed, repeats)
                if not _agreed(plain is not None):
                    continue
                sharded = _step_time(spec, x, targets, dev, seed, repeats, tp_mesh=mesh)
                if _agreed(sharded is not None) and plain and sharded:
                    out[(t, size)] = sharded / plain
    finally:
        torch.set_num_threads(previous)
    return out
