"""Where to cut a model: per-layer costs in, a contiguous split into stages out (torch-free).

Methods: explicit block counts ("4,3,5"), uniform by blocks, balanced by parameter bytes,
and balanced by measured (or estimated) time. The balanced methods are exact: a dynamic
programme over contiguous splits minimises the heaviest stage, then, among the splits that
reach that optimum, the sum of squared stage weights (so the other stages are even too).

Memory: a rank holds, for each of its stages, the parameters with their gradients and
optimizer state (``state_factor`` times the parameter bytes: 4 for fp32 AdamW), any older
weight versions the schedule stashes (``weight_versions[stage]``, PipeDream's), and the
activations of that stage's live micro-batches (``live[stage]``, the schedule's peak
per stage). A rank with several stages is charged its true peak when ``rank_live`` gives
the live counts of its stages at each step of its program (the planner derives them from
the schedule), else the sum of their peaks, an upper bound. With one stage per rank the
limit is a per-stage condition inside the dynamic programme; with several stages per rank
the limits couple the stages and a branch-and-bound search over the cuts takes over.

Unequal ranks: ``speeds[rank]`` (1 = the speed the costs were measured at) divides the
time of every stage on that rank, so balancing by time gives a slow rank fewer layers (a
stage held by several ranks runs at its slowest holder's speed); ``MemoryModel``'s
``rank_limit_bytes`` gives each rank its own memory limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.errors import InputError
from pipetrain.partition.layer_costs import LayerCost, MemoryModel, shared_within
from pipetrain.partition.search import (
    RankBytes,
    SearchTooLarge,
    StageBytes,
    Weights,
    coupled_search,
    min_bottleneck,
    min_squares,
)
from pipetrain.sim.ranks import slowdowns

__all__ = [
    "LayerCost",
    "MemoryModel",
    "Partition",
    "PartitionError",
    "StageRanks",
    "deferred_bytes",
    "format_bytes",
    "freed_at_input_bytes",
    "holders",
    "make_partition",
    "parse_split",
    "shared_within",
    "split_by_cost",
    "split_by_params",
    "split_explicit",
    "split_uniform",
]


# Each stage's rank, or the ranks of its replicas.
StageRanks = Sequence[int | Sequence[int]]


def holders(stage_to_rank: StageRanks) -> tuple[tuple[int, ...], ...]:
    """Normalise a stage -> rank(s) map to a tuple of rank tuples."""
    return tuple((r,) if isinstance(r, int) else tuple(r) for r in stage_to_rank)


class PartitionError(InputError):
    """A split that does not fit the model, or a limit that no split meets."""


@dataclass(frozen=True)
class Partition:
    """Stage -> its global layer indices (contiguous), with per-stage totals."""

    method: str
    stages: tuple[tuple[int, ...], ...]
    # The ranks that hold each stage: one, or several where the schedule runs replicas
    # (Chimera's two pipelines put model stage j on ranks j and p-1-j).
    stage_ranks: tuple[tuple[int, ...], ...]
    # Per stage, per sample: forward and backward seconds; parameter count and bytes;
    # activation bytes per sample.
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    params: tuple[int, ...]
    param_bytes: tuple[int, ...]
    activation_bytes_per_sample: tuple[float, ...]
    # Per stage, per sample: the linears' output gradients a split backward holds from I to
    # W (``LayerCost.deferred_bytes_per_sample``); empty: none counted.
    deferred_bytes_per_sample: tuple[float, ...] = ()
    # Per stage, per sample: what the end of a split backward's I lets go of its
    # activations (``LayerCost.freed_at_input_bytes_per_sample``); empty: nothing.
    freed_at_input_bytes_per_sample: tuple[float, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_to_rank(self) -> tuple[int, ...]:
        """The rank of each stage (of its first replica)."""
        return tuple(ranks[0] for ranks in self.stage_ranks)

    @property
    def num_ranks(self) -> int:
        return max(max(ranks) for ranks in self.stage_ranks) + 1

    @property
    def time(self) -> tuple[float, ...]:
        """Forward plus backward of each stage, per sample."""
        return tuple(f + b for f, b in zip(self.forward, self.backward, strict=True))

    @property
    def imbalance(self) -> float:
        """Slowest stage time over the mean stage time (1.0 = perfectly even)."""
        times = self.time
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    def rank_time(self) -> tuple[float, ...]:
        """Per sample, the compute of each rank: its stages, a replica doing its share."""
        totals = [0.0] * self.num_ranks
        for stage, ranks in enumerate(self.stage_ranks):
            for rank in ranks:
                totals[rank] += self.time[stage] / len(ranks)
        return tuple(totals)

    def blocks(self, costs: Sequence[LayerCost], stage: int) -> tuple[int, ...]:
        """Indices (0-based, among the blocks) of the transformer blocks on ``stage``."""
        block_layers = [i for i, c in enumerate(costs) if c.kind == "block"]
        position = {layer: b for b, layer in enumerate(block_layers)}
        return tuple(position[i] for i in self.stages[stage] if i in position)


def make_partition(
    method: str,
    costs: Sequence[LayerCost],
    bounds: Sequence[tuple[int, int]],
    stage_to_rank: StageRanks,
) -> Partition:
    """A ``Partition`` from half-open layer ranges, totals summed from ``costs``."""

    def total(attr: str, start: int, end: int) -> float:
        return float(sum(getattr(c, attr) for c in costs[start:end]))

    def per_stage(attr: str) -> tuple[float, ...]:
        return tuple(total(attr, s, e) for s, e in bounds)

    return Partition(
        method=method,
        stages=tuple(tuple(range(s, e)) for s, e in bounds),
        stage_ranks=holders(stage_to_rank),
        forward=per_stage("forward"),
        backward=per_stage("backward"),
        backward_input=per_stage("backward_input"),
        backward_weight=per_stage("backward_weight"),
        params=tuple(
            int(total("params", s, e)) - shared_within(costs, s, e, "tied_params")
            for s, e in bounds
        ),
        param_bytes=tuple(
            int(total("param_bytes", s, e)) - shared_within(costs, s, e, "tied_param_bytes")
            for s, e in bounds
        ),
        activation_bytes_per_sample=per_stage("activation_bytes_per_sample"),
        deferred_bytes_per_sample=per_stage("deferred_bytes_per_sample"),
        freed_at_input_bytes_per_sample=per_stage("freed_at_input_bytes_per_sample"),
    )


def deferred_bytes(partition: Partition, microbatch_size: int) -> tuple[float, ...]:
    """Per stage, what one micro-batch's split backward holds from its I to its W (zeros
    where the partition counts none)."""
    per_sample = partition.deferred_bytes_per_sample or (0.0,) * partition.num_stages
    return tuple(d * microbatch_size for d in per_sample)


def freed_at_input_bytes(partition: Partition, microbatch_size: int) -> tuple[float, ...]:
    """Per stage, what the end of one micro-batch's I lets go of its activations (zeros
    where the partition counts none)."""
    per_sample = partition.freed_at_input_bytes_per_sample or (0.0,) * partition.num_stages
    return tuple(f * microbatch_size for f in per_sample)


# ---------------------------------------------------------------- explicit and uniform
def parse_split(text: str) -> tuple[int, ...]:
    """``"4,3,5"`` -> (4, 3, 5); anything else is a one-line error."""
    parts = [p.strip() for p in text.split(",")]
    try:
        counts = tuple(int(p) for p in parts)
    except ValueError:
        raise PartitionError(
            f"--split {text!r} is not a list of whole numbers: write blocks per stage, e.g. 4,3,5"
        ) from None
    if any(c < 0 for c in counts):
        raise PartitionError(
            f"--split {text!r} has a negative count: every stage holds 0 or more blocks"
        )
    return counts


def _bounds_from_block_counts(
    costs: Sequence[LayerCost], counts: Sequence[int], what: str
) -> list[tuple[int, int]]:
    """Cut after the given numbers of blocks; leading layers join stage 0, trailing the last."""
    block_layers = [i for i, c in enumerate(costs) if c.kind == "block"]
    n_blocks = len(block_layers)
    if sum(counts) != n_blocks:
        raise PartitionError(
            f"{what} {','.join(map(str, counts))} adds up to {sum(counts)} blocks but the model has "
            f"{n_blocks}: make the counts sum to {n_blocks}"
        )
    if not block_layers:
        raise PartitionError(
            f"{what} counts blocks but the model has none: use a balanced method instead"
        )
    first_block = block_layers[0]
    if block_layers != list(range(first_block, first_block + n_blocks)):
        raise PartitionError(
            f"{what} needs the blocks to be consecutive layers: use a balanced method instead"
        )
    bounds: list[tuple[int, int]] = []
    start = 0
    cursor = first_block
    for s, count in enumerate(counts):
        cursor += count
        end = len(costs) if s == len(counts) - 1 else cursor
        if end <= start:
            raise PartitionError(
                f"{what} {','.join(map(str, counts))} leaves stage {s} with no layer: give every "
                "stage but the first and the last at least one block"
            )
        bounds.append((start, end))
        start = end
    return bounds


def split_explicit(
    costs: Sequence[LayerCost], counts: Sequence[int], stage_to_rank: StageRanks
) -> Partition:
    """Blocks per stage as given; the embedding joins the first stage and the head the last."""
    if len(counts) != len(stage_to_rank):
        raise PartitionError(
            f"--split has {len(counts)} stages but the schedule needs {len(stage_to_rank)}: give "
            f"{len(stage_to_rank)} counts"
        )
    return make_partition(
        "explicit", costs, _bounds_from_block_counts(costs, counts, "--split"), stage_to_rank
    )


def split_uniform(costs: Sequence[LayerCost], stage_to_rank: StageRanks) -> Partition:
    """The same number of blocks on every stage (the first stages take one more if needed)."""
    n_stages = len(stage_to_rank)
    n_blocks = sum(1 for c in costs if c.kind == "block")
    if n_blocks < n_stages:
        raise PartitionError(
            f"uniform split of {n_blocks} blocks over {n_stages} stages leaves stages empty: use fewer "
            "stages (--pp, --chunks) or --balance params"
        )
    base, extra = divmod(n_blocks, n_stages)
    counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    return make_partition(
        "uniform", costs, _bounds_from_block_counts(costs, counts, "uniform split"), stage_to_rank
    )


# ---------------------------------------------------------------- balanced (exact)
def split_by_params(
    costs: Sequence[LayerCost], stage_to_rank: StageRanks, memory: MemoryModel | None = None
) -> Partition:
    """Minimise the largest stage parameter count (then even out the rest)."""
    weights = [float(c.param_bytes) for c in costs]
    return _balanced("params", costs, weights, stage_to_rank, memory, None)


def split_by_cost(
    costs: Sequence[LayerCost],
    stage_to_rank: StageRanks,
    memory: MemoryModel | None = None,
    speeds: Sequence[float] | None = None,
) -> Partition:
    """Minimise the slowest stage's forward + backward time (then even out the rest), each
    stage's time divided by its rank's speed when ``speeds`` are given."""
    return _balanced("cost", costs, [c.time for c in costs], stage_to_rank, memory, speeds)


def _balanced(
    method: str,
    costs: Sequence[LayerCost],
    weights: Sequence[float],
    stage_to_rank: StageRanks,
    memory: MemoryModel | None,
    speeds: Sequence[float] | None,
) -> Partition:
    n_layers, n_stages = len(costs), len(stage_to_rank)
    ranks = holders(stage_to_rank)
    if n_stages > n_layers:
        raise PartitionError(
            f"{n_stages} stages but only {n_layers} layers: use fewer stages (--pp, --chunks) or a bigger model"
        )
    if memory is not None:
        _check_memory_model(memory, ranks, n_stages)
    seg = Weights(weights, slowdowns(ranks, speeds))
    ranks_single = all(len(r) == 1 for r in ranks) and len({r[0] for r in ranks}) == n_stages
    stage_bytes = None if memory is None else StageBytes(costs, memory)
    fits: Callable[[int, int, int], bool] = lambda s, i, j: True  # noqa: E731
    limits = [] if memory is None else [memory.limit_of(r) for r in range(_num_ranks(ranks))]
    if memory is not None and stage_bytes is not None and ranks_single:
        mem = stage_bytes
        fits = lambda s, i, j: mem(s, i, j) <= limits[ranks[s][0]]  # noqa: E731

    bottleneck = min_bottleneck(n_layers, n_stages, seg, fits)
    bounds = None
    if bottleneck is not None:
        bounds = min_squares(n_layers, n_stages, seg, fits, bottleneck)
    rank_bytes = None if stage_bytes is None else RankBytes(stage_bytes, ranks)
    if (
        memory is not None
        and rank_bytes is not None
        and not ranks_single
        and (bounds is None or not rank_bytes.fit(bounds, limits))
    ):
        try:
            bounds = coupled_search(n_layers, n_stages, seg, rank_bytes, limits)
        except SearchTooLarge:
            raise PartitionError(
                f"the memory limit couples the {n_stages} stages of this placement and the exact "
                "search is too large: give the split by hand with --split, or raise --memory-limit"
            ) from None
    if bounds is None:
        assert memory is not None  # without a limit every split of >= 1 layer per stage is allowed
        raise _nothing_fits(memory, n_stages)
    return make_partition(method, costs, bounds, stage_to_rank)


def _check_memory_model(memory: MemoryModel, ranks: Sequence[Sequence[int]], n_stages: int) -> None:
    """The memory model gives a count for every stage (and rank) of the placement."""
    if len(memory.live) != n_stages:
        raise PartitionError(
            f"memory model has {len(memory.live)} live counts for {n_stages} stages"
        )
    if memory.rank_live and (
        len(memory.rank_live) < max(max(r) for r in ranks) + 1
        or any(len(v) != n_stages for points in memory.rank_live for v in points)
    ):
        raise PartitionError(
            f"memory model's rank_live does not give {n_stages} counts for every rank"
        )
    if memory.weight_versions and len(memory.weight_versions) != n_stages:
        raise PartitionError(
            f"memory model has {len(memory.weight_versions)} weight version counts for "
            f"{n_stages} stages"
        )


def _nothing_fits(memory: MemoryModel, n_stages: int) -> PartitionError:
    """What to change when no split fits the memory limit."""
    smaller = (
        "a smaller --batch-size (this schedule holds the whole batch)"
        if memory.whole_batch
        else "a smaller micro-batch (--microbatches)"
    )
    what, flag = (
        ("the per-rank memory limits", "--rank-memory")
        if memory.rank_limit_bytes
        else (
            f"the memory limit of {format_bytes(memory.limit_bytes)} per rank",
            "--memory-limit",
        )
    )
    return PartitionError(
        f"no split into {n_stages} stages fits {what} "
        f"at micro-batch size {memory.microbatch_size}: raise {flag}, use more ranks (--pp), or "
        f"{smaller}"
    )


def _num_ranks(ranks: Sequence[Sequence[int]]) -> int:
    return max(max(r) for r in ranks) + 1


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
