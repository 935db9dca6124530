"""Profile the layers at several micro-batch sizes, on as many processes as the run has.

On a CPU the run's processes share the cores and the memory bandwidth: a layer profiled
alone runs faster than it will in the run (measured here: 10-15% at two processes on two
cores; time-slicing doubles it at four). So on a CPU the profile runs in ``processes``
spawned processes at once, each with the threads the trainer will give it, which start
each size together (a barrier) and measure the same layers; each figure is the median
over the processes. On a GPU each process of the run has its own device, so one process
profiles alone.

The same processes first time the run's collectives over gloo (a send/recv ping-pong and
all-reduces over two ranks and over all, at 64 KiB, 1 MiB and 8 MiB; a straight line
through each gives the latency and the bandwidth), while no layer runs: ``Links``. Last,
for each tp degree the search uses, they time a step sharded over that many of them
against the unsharded step (``profile_tp``): ``Profile.tp_ratio``.
"""

from __future__ import annotations

import multiprocessing
import socket
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from pipetrain.heap import allocator_library, preloading
from pipetrain.models.config import ModelConfig
from pipetrain.partition.balance import LayerCost
from pipetrain.partition.cost_curve import CostCurve
from pipetrain.partition.layer_costs import TIMES, scaled_times
from pipetrain.partition.profile_step import step_peak_bytes

__all__ = ["Links", "Profile", "profile_curve"]

# Seconds a spawned profile's process waits at a barrier for the others (a stuck one).
_TIMEOUT_S = 900.0
# Message sizes the links are timed at: latency-bound to bandwidth-bound.
_LINK_BYTES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


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
    tp_sizes: Mapping[int, Sequence[int]] | None = None,
) -> tuple[
    dict[int, list[LayerCost]],
    tuple[dict[int, float], dict[int, float]],
    dict[tuple[int, int], float],
]:
    """Per size: the layers' per-sample costs, and a whole step's peak bytes in one
    process, without and with recomputation; in a process group, per (tp degree, size) of
    ``tp_sizes``, a step sharded over that many ranks over the unsharded one."""
    from pipetrain.models.spec import model_spec
    from pipetrain.partition.profile import profile_layers
    from pipetrain.partition.profile_tp import tp_step_ratios

    spec = model_spec(config)
    rows = max([*sizes, *(s for ss in (tp_sizes or {}).values() for s in ss)])
    ids = torch.randint(
        0, config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(seed)
    )
    out: dict[int, list[LayerCost]] = {}
    # Memory first, smallest size first, in a process that has run nothing else: the
    # heap that the other measurements leave behind would count in a later peak.
    steps = {size: step_peak_bytes(spec, ids[:size], device, seed) for size in sizes}
    recomputed = {
        size: step_peak_bytes(spec, ids[:size], device, seed, recompute=True) for size in sizes
    }
    for size in sizes:
        if barrier is not None:
            barrier.wait(timeout=_TIMEOUT_S)
        layers = profile_layers(
            spec, ids[:size], seed=seed, device=device, threads=threads, repeats=repeats
        )
        if barrier is not None:
            barrier.wait(timeout=_TIMEOUT_S)
        chain = _chain_time(spec, ids[:size], device, threads, repeats, seed)
        out[size] = _scaled_to_chain(layers, chain, size)
    ratios: dict[tuple[int, int], float] = {}
    if barrier is not None and tp_sizes:  # last: its DTensor steps leave their heap behind
        barrier.wait(timeout=_TIMEOUT_S)
        ratios = tp_step_ratios(config, spec, ids, device, threads, repeats, seed, tp_sizes)
    return out, (steps, recomputed), ratios


def _chain_time(
    spec: Any, ids: torch.Tensor, device: str, threads: int, repeats: int, seed: int
) -> float | None:
    """Median seconds of the whole model's forward, loss and backward on one micro-batch,
    as a step runs them (None where the model does not fit here)."""
    import torch.nn.functional as F

    from pipetrain.models.stage import build_stage

    dev = torch.device(device)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_stage(spec, list(range(len(spec.layers))), seed=seed, device=dev)
        x = ids.to(dev)
        targets = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(seed))
        targets = targets.to(dev)
        samples = []
        # A whole step varies more than one layer: at least 5 timed, the median kept.
        for _ in range(max(repeats, 5) + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            start = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), targets.flatten())
            torch.autograd.backward(loss)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            samples.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    except (RuntimeError, MemoryError):  # out of memory: the layers alone stand
        return None
    finally:
        torch.set_num_threads(previous)
    return statistics.median(samples[1:])  # the first allocates


def _scaled_to_chain(layers: list[LayerCost], chain: float | None, size: int) -> list[LayerCost]:
    """Each layer's times scaled so that their sum is the whole chain's time per sample:
    a layer timed alone keeps its data in the caches, one in a step finds the others'
    there (measured here: 15-25% slower with two processes holding a step's activations)."""
    per_sample = sum(c.forward + c.backward for c in layers)
    if chain is None or per_sample <= 0:
        return layers
    ratio = chain / size / per_sample
    return scaled_times(layers, ratio)


@dataclass(frozen=True)
class Links:
    """The run's collectives measured between the profile's processes (gloo on a CPU)."""

    p2p_latency: float  # seconds of one send/recv, whatever its size
    p2p_bandwidth: float  # bytes/s of one send/recv beyond its latency
    # (group size, seconds per call, bytes/s in ring terms): Hardware.allreduce's form.
    allreduce: tuple[tuple[int, float, float], ...]


@dataclass(frozen=True)
class Profile:
    """What ``profile_curve`` measured."""

    curve: CostCurve
    links: Links | None
    step_bytes: dict[int, float]  # size -> a whole-model step's peak bytes (0: unmeasured)
    recompute_step_bytes: dict[int, float]  # the same with every block recomputed
    # (tp degree, size) -> a step sharded over that many ranks over the unsharded step,
    # timed in the profile's processes at once (profile_tp); empty: tp unmeasured.
    tp_ratio: dict[tuple[int, int], float] = field(default_factory=dict)


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = a + b * n over (n, t); a kept >= 0, b > 0."""
    n_mean = statistics.fmean(n for n, _ in points)
    t_mean = statistics.fmean(t for _, t in points)
    spread = sum((n - n_mean) ** 2 for n, _ in points)
    slope = sum((n - n_mean) * (t - t_mean) for n, t in points) / spread if spread else 0.0
    slope = max(slope, 1e-15)
    return max(0.0, t_mean - slope * n_mean), slope


def _timed_median(fn: Any, repeats: int = 5) -> float:
    import torch.distributed as dist

    fn()  # the first call sets up the connection's buffers
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _ping(buffer: torch.Tensor, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(buffer, 1)
    elif rank == 1:
        dist.recv(buffer, 0)
        dist.send(buffer, 0)


def _measure_links(rank: int, world: int) -> Links:
    """All-reduces over 2 ranks and over all, and a send/recv ping-pong between ranks 0 and 1."""
    import torch.distributed as dist

    pairs = dist.new_group([0, 1])  # every rank takes part in making it
    groups = {2: pairs, world: None} if world > 2 else {2: None}
    reduce_points: dict[int, list[tuple[float, float]]] = {g: [] for g in groups}
    p2p_points: list[tuple[float, float]] = []
    for nbytes in _LINK_BYTES:
        buffer = torch.ones(nbytes // 4)
        for size, group in groups.items():
            if group is None or rank < 2:
                took = _timed_median(partial(dist.all_reduce, buffer, group=group))
            else:
                took = 0.0  # not in the pair: it only meets the others' barriers
                _timed_median(lambda: None)
            reduce_points[size].append((2.0 * (size - 1) / size * nbytes, took))
        p2p_points.append((float(nbytes), _timed_median(partial(_ping, buffer, rank)) / 2))
    p2p_latency, p2p_slope = _fit(p2p_points)
    allreduce = []
    for size, points in sorted(reduce_points.items()):
        latency, slope = _fit(points)
        allreduce.append((size, latency, 1.0 / slope))
    return Links(p2p_latency, 1.0 / p2p_slope, tuple(allreduce))


def _child(
    queue: Any,
    barrier: Any,
    args: tuple[Any, ...],
    rank: int,
    world: int,
    port: int,
    tp_sizes: Mapping[int, Sequence[int]] | None = None,
) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        links = _measure_links(rank, world)
        dist.barrier()
        costs = _measure_sizes(*args, barrier=barrier, tp_sizes=tp_sizes)
        queue.put(("ok", (rank, costs, links)))
    except BaseException as exc:  # reported by the parent, which names the profile
        barrier.abort()
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(queue: Any, children: Sequence[Any], poll_s: float = 5.0) -> list[Any]:
    """Every child's result, waited for as long as they live: a wide model's profile on
    shared cores took longer than any fixed total (llama-wide on 4 processes of 2 cores,
    over 900 s), while a stuck child ends at a barrier's timeout and posts its error. A
    child that ended without a result (killed, out of memory) is one line."""
    import queue as queues

    results: list[Any] = []
    while len(results) < len(children):
        try:
            results.append(queue.get(timeout=poll_s))
            continue
        except queues.Empty:
            pass
        exited = [c.exitcode for c in children if c.exitcode is not None]
        if len(exited) <= len(results):
            continue  # every child that ended has posted; the others are still measuring
        try:  # a child posts before it exits: one more look before calling it lost
            results.append(queue.get(timeout=poll_s))
        except queues.Empty:
            raise RuntimeError(
                f"the profile failed in a spawned process: {len(exited) - len(results)} of "
                f"{len(children)} ended without a result (exit status "
                f"{', '.join(map(str, exited))}; killed or out of memory?)"
            ) from None
    return results


def _median_costs(runs: Sequence[Sequence[LayerCost]]) -> list[LayerCost]:
    out = []
    for layers in zip(*runs, strict=True):
        times = {name: statistics.median(getattr(c, name) for c in layers) for name in TIMES}
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
    tp_sizes: Mapping[int, Sequence[int]] | None = None,
) -> Profile:
    """Per-sample layer costs at each of ``sizes``, the links between the processes and a
    step's bytes; on a CPU measured by ``processes`` processes at once (see the module
    doc), elsewhere by this one alone (links None: the run's devices are not here).
    ``tp_sizes``: tp degree -> the sizes to time a step sharded over that many of the
    processes at (degrees that do not divide ``processes`` are skipped; none alone)."""
    sizes = sorted(set(sizes))
    args = (config, seq_len, sizes, str(device), threads, repeats, seed)
    if device.type != "cpu" or processes <= 1:
        costs, (steps, recomputed), _ = _measure_sizes(*args)
        return Profile(CostCurve(costs), None, steps, recomputed)
    ctx = multiprocessing.get_context("spawn")  # a forked torch can hang in its thread pools
    queue = ctx.Queue()
    barrier = ctx.Barrier(processes)
    port = _free_port()
    children = [
        ctx.Process(target=_child, args=(queue, barrier, args, rank, processes, port, tp_sizes))
        for rank in range(processes)
    ]
    # The trainer's processes on a CPU run with run.allocator's default (tcmalloc where
    # installed): a step's bytes measured under another allocator would not be theirs.
    with preloading(allocator_library("auto")):
        for child in children:
            child.start()
    try:
        results = _collect(queue, children)
    finally:
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
    errors = [text for status, text in results if status == "error"]
    if errors:
        raise RuntimeError(f"the profile failed in a spawned process: {errors[0]}")
    runs = [costs for _, (_rank, (costs, _memory, _tp), _links) in results]
    curve = CostCurve({size: _median_costs([r[size] for r in runs]) for size in sizes})
    measures = [m for _, (_rank, (_c, m, _tp), _l) in results]
    tp_runs = [tp for _, (_rank, (_c, _m, tp), _l) in results]
    # Each process times its own group's step: the median over all, where all measured.
    tp_ratio = {
        key: statistics.median(r[key] for r in tp_runs)
        for key in tp_runs[0]
        if all(key in r for r in tp_runs)
    }
    steps = {size: statistics.median(m[0][size] for m in measures) for size in sizes}
    recomputed = {size: statistics.median(m[1][size] for m in measures) for size in sizes}
    # Rank 0 takes part in every link timed (the others may wait at the barriers).
    links = next(links for _, (rank, _costs, links) in results if rank == 0)
    return Profile(curve, links, steps, recomputed, tp_ratio)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
