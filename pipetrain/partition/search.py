"""The exact searches behind the balanced splits (torch-free).

Splits are half-open layer ranges ``(start, end)``, one per stage, covering every layer in
order. ``seg(stage, i, j)`` (a ``Weights``) is the weight of layers i..j-1 on ``stage``:
their summed time or parameter bytes times the stage's factor (1 / its rank's speed when
ranks differ), non-negative, so a longer range never weighs less; ``fits(stage, i, j)``
says whether a range may be that stage under its rank's memory limit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipetrain.partition.layer_costs import LayerCost, MemoryModel

__all__ = [
    "RankBytes",
    "SearchTooLarge",
    "StageBytes",
    "Weights",
    "coupled_search",
    "min_bottleneck",
    "min_squares",
]


class SearchTooLarge(Exception):
    """The coupled search ran out of its node budget (the caller says what to do instead)."""


# Search nodes the memory-coupled search may visit before it gives up (a few seconds).
_SEARCH_BUDGET = 300_000


class StageBytes:
    """``MemoryModel.stage_bytes`` in O(1) from prefix sums (the search asks it O(S L^2) times)."""

    def __init__(self, costs: Sequence[LayerCost], memory: MemoryModel) -> None:
        self.memory = memory
        # (owner, copy, bytes) of each tied weight: one tensor where a stage holds both.
        self.ties = [
            (c.tied_to, i, c.tied_param_bytes) for i, c in enumerate(costs) if c.tied_to is not None
        ]
        self.params = [0.0]
        self.acts = [0.0]
        for c in costs:
            self.params.append(self.params[-1] + c.param_bytes)
            self.acts.append(self.acts[-1] + c.activation_bytes_per_sample)

    def __call__(self, stage: int, start: int, end: int) -> float:
        live = self.memory.live[stage]
        return self.static(stage, start, end) + self.activations(start, end) * live

    def static(self, stage: int, start: int, end: int) -> float:
        """Weights (every version held), gradients and optimizer state of the layers."""
        params = self.params[end] - self.params[start]
        params -= sum(
            b
            for owner, copy, b in self.ties
            if start <= min(owner, copy) and max(owner, copy) < end
        )
        return self.memory.param_factor(stage) * params

    def activations(self, start: int, end: int) -> float:
        """What one micro-batch leaves on the layers for the backward."""
        return (self.acts[end] - self.acts[start]) * self.memory.microbatch_size


class Weights:
    """Stage weights from per-layer weights: ``seg(stage, i, j)`` is the sum over layers
    i..j-1 times ``factor[stage]``; a stage on a rank of half the speed weighs twice."""

    def __init__(self, layer_weights: Sequence[float], factor: Sequence[float]) -> None:
        self.prefix = [0.0]
        for w in layer_weights:
            self.prefix.append(self.prefix[-1] + w)
        self.factor = tuple(factor)
        # Speeds (1 / factor) of stages s.. and their squares, summed: the bounds below.
        self.speed_after = [0.0] * (len(self.factor) + 1)
        self.square_after = [0.0] * (len(self.factor) + 1)
        for stage in range(len(self.factor) - 1, -1, -1):
            speed = 1.0 / self.factor[stage]
            self.speed_after[stage] = self.speed_after[stage + 1] + speed
            self.square_after[stage] = self.square_after[stage + 1] + speed * speed

    def __call__(self, stage: int, start: int, end: int) -> float:
        return (self.prefix[end] - self.prefix[start]) * self.factor[stage]

    def rest_bounds(self, stage: int, start: int) -> tuple[float, float]:
        """Lower bounds for stages ``stage``.. covering layers ``start``..: on their heaviest
        (the raw weight R spread in proportion to speed: R / sum(speed)) and on their sum of
        squares (R^2 / sum(speed^2), the least over all ways to share R)."""
        rest = self.prefix[-1] - self.prefix[start]
        return rest / self.speed_after[stage], rest * rest / self.square_after[stage]


def min_bottleneck(
    n_layers: int,
    n_stages: int,
    seg: Weights,
    fits: Callable[[int, int, int], bool],
) -> float | None:
    """best[s][j]: the least possible heaviest stage when stages 0..s-1 cover layers 0..j-1."""
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n_layers - (n_stages - s) + 1):
            value = inf
            for i in range(s - 1, j):
                if best[s - 1][i] < inf and fits(s - 1, i, j):
                    value = min(value, max(best[s - 1][i], seg(s - 1, i, j)))
            best[s][j] = value
    result = best[n_stages][n_layers]
    return None if result == inf else result


def min_squares(
    n_layers: int,
    n_stages: int,
    seg: Weights,
    fits: Callable[[int, int, int], bool],
    bottleneck: float,
) -> list[tuple[int, int]] | None:
    """Among splits whose stages all weigh <= bottleneck, the one with least sum of squares."""
    cap = bottleneck * (1 + 1e-12) + 1e-300
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    choice = [[-1] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for j in range(s, n_layers - (n_stages - s) + 1):
            for i in range(s - 1, j):
                w = seg(s - 1, i, j)
                if best[s - 1][i] < inf and w <= cap and fits(s - 1, i, j):
                    value = best[s - 1][i] + w * w
                    if value < best[s][j]:
                        best[s][j], choice[s][j] = value, i
    if best[n_stages][n_layers] == inf:
        return None
    bounds: list[tuple[int, int]] = []
    j = n_layers
    for s in range(n_stages, 0, -1):
        i = choice[s][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


class RankBytes:
    """What each rank holds for a split: the weights, gradients and optimizer state of its
    stages, and its activations at their peak over the points of its program.

    A point is one moment's live micro-batches per stage (``MemoryModel.rank_live``);
    without them a rank has one point, every stage it holds at its own peak.
    """

    def __init__(self, stage_bytes: StageBytes, ranks: Sequence[Sequence[int]]) -> None:
        self.stage_bytes = stage_bytes
        # Each stage's ranks, once each (a rank may hold two replicas of one stage).
        self.ranks = tuple(tuple(sorted(set(r))) for r in ranks)
        self.num_ranks = max(max(r) for r in ranks) + 1
        memory = stage_bytes.memory
        if memory.rank_live:
            self.points = tuple(tuple(memory.rank_live[r]) for r in range(self.num_ranks))
        else:
            own = [[0] * len(ranks) for _ in range(self.num_ranks)]
            for stage, holders in enumerate(ranks):
                for rank in holders:
                    own[rank][stage] += memory.live[stage]
            self.points = tuple((tuple(counts),) for counts in own)

    def fit(self, bounds: Sequence[tuple[int, int]], limits: Sequence[float]) -> bool:
        """Whether every rank stays within its limit (``limits[rank]``) under ``bounds``."""
        static = [0.0] * self.num_ranks
        acts = [[0.0] * len(p) for p in self.points]
        for s, (i, j) in enumerate(bounds):
            self.add(static, acts, s, i, j, 1.0)
        return all(
            static[r] + max(acts[r], default=0.0) <= limits[r] for r in range(self.num_ranks)
        )

    def add(
        self,
        static: list[float],
        acts: list[list[float]],
        stage: int,
        start: int,
        end: int,
        sign: float,
    ) -> None:
        """Put layers start..end-1 on ``stage`` (``sign`` 1) or take them off again (-1)."""
        fixed = self.stage_bytes.static(stage, start, end)
        per_microbatch = self.stage_bytes.activations(start, end)
        for rank in self.ranks[stage]:
            static[rank] += sign * fixed
            for k, counts in enumerate(self.points[rank]):
                acts[rank][k] += sign * counts[stage] * per_microbatch

    def would_fit(
        self,
        static: Sequence[float],
        acts: Sequence[Sequence[float]],
        stage: int,
        start: int,
        end: int,
        limits: Sequence[float],
    ) -> bool:
        fixed = self.stage_bytes.static(stage, start, end)
        per_microbatch = self.stage_bytes.activations(start, end)
        for rank in self.ranks[stage]:
            peak = max(
                (
                    a + counts[stage] * per_microbatch
                    for a, counts in zip(acts[rank], self.points[rank], strict=True)
                ),
                default=0.0,
            )
            if static[rank] + fixed + peak > limits[rank]:
                return False
        return True


def coupled_search(
    n_layers: int,
    n_stages: int,
    seg: Weights,
    rank_bytes: RankBytes,
    limits: Sequence[float],
) -> list[tuple[int, int]] | None:
    """Branch and bound over the cuts when one rank holds several stages under a limit.

    Like the dynamic programme: the least heaviest stage first, then, among the splits whose
    stages stay within it, the least sum of squares. Raises ``SearchTooLarge`` when the
    first search runs out of budget; when the second does, the first's split stands.
    """
    fewest = _branch_and_bound(n_layers, n_stages, seg, rank_bytes, limits, None)
    if fewest is None:
        return None
    cap = max(seg(s, i, j) for s, (i, j) in enumerate(fewest)) * (1 + 1e-12) + 1e-300
    try:
        return _branch_and_bound(n_layers, n_stages, seg, rank_bytes, limits, cap) or fewest
    except SearchTooLarge:
        return fewest


def _branch_and_bound(
    n_layers: int,
    n_stages: int,
    seg: Weights,
    rank_bytes: RankBytes,
    limits: Sequence[float],
    cap: float | None,
) -> list[tuple[int, int]] | None:
    """Without ``cap``: minimise the heaviest stage. With it: minimise the sum of squared
    stage weights over the splits whose stages all weigh at most ``cap``."""
    best_value = float("inf")
    best_bounds: list[tuple[int, int]] | None = None
    visited = 0
    static = [0.0] * rank_bytes.num_ranks
    acts = [[0.0] * len(p) for p in rank_bytes.points]
    path: list[tuple[int, int]] = []

    def visit(s: int, i: int, value: float) -> None:
        nonlocal best_value, best_bounds, visited
        visited += 1
        if visited > _SEARCH_BUDGET:
            raise SearchTooLarge(f"more than {_SEARCH_BUDGET} nodes")
        if s == n_stages:
            if i == n_layers and value < best_value:
                best_value, best_bounds = value, list(path)
            return
        last = n_layers - (n_stages - s - 1)
        for j in range(i + 1, last + 1) if s < n_stages - 1 else (n_layers,):
            w = seg(s, i, j)
            new = max(value, w) if cap is None else value + w * w
            if new >= best_value or (cap is not None and w > cap):
                break  # longer segments only weigh more
            if not rank_bytes.would_fit(static, acts, s, i, j, limits):
                break  # and hold more
            if s < n_stages - 1:
                # The later stages share the rest: at best in proportion to their speeds.
                heaviest, squares = seg.rest_bounds(s + 1, j)
                bound = heaviest if cap is None else new + squares
                if bound >= best_value or (cap is not None and heaviest > cap):
                    continue
            rank_bytes.add(static, acts, s, i, j, 1.0)
            path.append((i, j))
            visit(s + 1, j, new)
            path.pop()
            rank_bytes.add(static, acts, s, i, j, -1.0)

    visit(0, 0, 0.0)
    return best_bounds
