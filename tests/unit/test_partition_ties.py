"""pipetrain.partition.ties: splits as balanced as the balancer's, and the fastest of them."""

from __future__ import annotations

import random
from dataclasses import replace

from pipetrain.cli.plan_auto import HARDWARE
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import search
from pipetrain.partition.balance import split_explicit
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layouts import AutoRequest, Layout
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.stages import stage_ranks_of
from pipetrain.partition.ties import fastest_tie, tied_block_counts

CONFIG = get_model_config("llama-default")
CPU = replace(HARDWARE["cpu"], shared_cores=2.0, per_action=2e-3)


def _costs(tp: int, mb: int = 1, ep: int = 1):  # type: ignore[no-untyped-def]
    return estimate_costs(CONFIG, 128, flops_per_second=CPU.flops, tp=tp)


def _noisy(seed: int):  # type: ignore[no-untyped-def]
    # Blocks measured one by one differ by a few percent, as a profile's do.
    rng = random.Random(seed)
    factors = [1 + rng.uniform(-0.03, 0.03) for _ in range(CONFIG.n_layers + 2)]

    def costs(tp: int, mb: int = 1, ep: int = 1):  # type: ignore[no-untyped-def]
        return [
            replace(c, forward=c.forward * f, backward=c.backward * f,
                    backward_input=c.backward_input * f, backward_weight=c.backward_weight * f)
            for c, f in zip(_costs(tp), factors, strict=True)
        ]  # fmt: skip

    return costs


def _stage_times(costs, counts):  # type: ignore[no-untyped-def]
    partition = split_explicit(costs, counts, tuple((s,) for s in range(len(counts))))
    return [f + b for f, b in zip(partition.forward, partition.backward, strict=True)]


def test_exact_ties_are_every_arrangement_of_the_same_stage_times() -> None:
    costs = _costs(1)
    counts = (2, 1, 2, 1, 2, 1, 2, 1)  # 12 blocks on 8 stages: four take two
    ties = tied_block_counts(costs, counts, tolerance=0.0, limit=1000)
    assert ties[0] == counts and len(set(ties)) == len(ties)
    times = _stage_times(costs, counts)
    for tie in ties:
        assert sum(tie) == 12 and all(n >= 1 for n in tie[1:-1])
        other = _stage_times(costs, tie)
        assert max(other) <= max(times) * (1 + 1e-9)
        assert sum(t * t for t in other) <= sum(t * t for t in times) * (1 + 1e-9)
    # The head's stage cannot take a second block within the slowest stage, so any four
    # of the seven stages before it take two: C(7, 4).
    assert len(ties) == 35 and all(tie[-1] == 1 for tie in ties)
    # An even split of two stages has no other as balanced.
    assert tied_block_counts(costs, (6, 6)) == [(6, 6)]


def test_a_deep_model_finds_its_limit_of_ties_within_the_visit_budget() -> None:
    # Options nearest an even share come first: taken in order, the budget found one.
    config = get_model_config("llama3-70b")
    costs = estimate_costs(config, 4096, flops_per_second=1e15, tp=8)
    ties = tied_block_counts(costs, (4,) * 8 + (3,) * 16, limit=64)
    assert len(ties) == 64 and len(set(ties)) == 64


def test_fastest_tie_is_the_fastest_of_the_ties_and_never_slower() -> None:
    layout = Layout("interleaved-1f1b", 2, 1, 1, 4, 2, False, False)
    scorer = Scorer(CONFIG, AutoRequest(2, 32, 128), _noisy(0), CPU)
    scored = scorer.evaluate(layout)
    assert scored is not None
    best = fastest_tie(scorer, scored)
    costs = scorer.layout_costs(layout)
    schedule = scorer.schedule(layout)
    ranks = stage_ranks_of(schedule.placement)
    times = [
        scorer.score(layout, schedule, split_explicit(costs, counts, ranks), False).step_time
        for counts in tied_block_counts(costs, scored.split)
    ]
    assert best.step_time == min(times)
    # Here the balancer's own split is not the fastest: the noise decided it.
    assert best.step_time < scored.step_time * 0.99 and best.split != scored.split
    # Rescored at its own split (as a calibration does), the tie predicts the same.
    assert scorer.rescore(best).step_time == best.step_time


def test_the_search_keeps_the_fastest_tie_of_its_top() -> None:
    # pp = 1 (1F1B) is always in the space; the top reaches the interleaved layouts.
    request = AutoRequest(
        2, 32, 128, schedules=("interleaved-1f1b",), chunks=(4,), max_tp=1, recompute=(False,),
        top=12,
    )  # fmt: skip
    scorer = Scorer(CONFIG, request, _noisy(0), CPU)
    plan = search(CONFIG, request, _noisy(0), CPU)
    top = [s for s in plan.ranked[: request.top] if s.layout.pp > 1]
    assert top
    moved = 0
    for scored in top:
        assert fastest_tie(scorer, scored).step_time == scored.step_time
        balanced = scorer.evaluate(scored.layout)
        assert balanced is not None and scored.step_time <= balanced.step_time
        moved += scored.split != balanced.split
    assert moved  # the noise left some balanced split slower than a tie
