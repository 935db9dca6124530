"""``--measure K`` under a memory budget: when no candidate fits as measured, the planner
searches again under the limit lowered by what the candidates went over, and keeps the
fastest of the new candidates that fits as measured."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

import pipetrain.cli.plan_measure as plan_measure
from pipetrain.cli.plan_auto import HARDWARE, _measured_winner
from pipetrain.cli.plan_measure import Measured, lowered_limit
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import AutoPlan, AutoRequest, search
from pipetrain.partition.estimate import estimate_costs

_CONFIG = get_model_config("llama-tiny")
_HW = HARDWARE["cpu"]


def _costs(tp: int, mb: int = 1) -> Any:
    return estimate_costs(_CONFIG, 32, flops_per_second=_HW.flops, tp=tp)


def _plan(limit: float | None) -> AutoPlan:
    return search(_CONFIG, AutoRequest(2, 16, 32, limit, top=4), _costs, _HW)


def _measured(scored: Any, over: float, error: str = "") -> Measured:
    peak = () if error else (int(scored.peak_bytes + over),)
    return Measured(scored, 1.0, 1000.0, peak, (), error=error)


def test_the_lowered_limit_takes_off_the_most_a_candidate_went_over() -> None:
    a, b = _plan(None).ranked[:2]
    runs = [_measured(a, 3e6), _measured(b, 5e6), _measured(a, 0, error="boom")]
    assert lowered_limit(runs, 50e6) == pytest.approx(45e6, abs=1)
    # Under the prediction everywhere: the limit stands.
    assert lowered_limit([_measured(a, -1e6)], 50e6) == pytest.approx(50e6)
    assert lowered_limit([_measured(a, 0, error="boom")], 50e6) is None
    assert lowered_limit([_measured(a, 60e6)], 50e6) is None  # nothing would be left


def test_none_fitting_as_measured_plans_again_under_the_lowered_limit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    free = _plan(None)
    # A budget that the predicted winner meets, but that every real process exceeds by
    # more than the winner's margin.
    limit = sorted(s.peak_bytes for s in free.ranked)[len(free.ranked) // 2] * 1.01
    plan = _plan(limit)
    over = limit - plan.ranked[0].peak_bytes + 1e5
    rounds: list[list[Any]] = []

    def measure_top(candidates: Any, *args: Any, **kwargs: Any) -> list[Measured]:
        rounds.append(list(candidates))
        return [_measured(s, over) for s in candidates]

    monkeypatch.setattr(plan_measure, "measure_top", measure_top)
    args = argparse.Namespace(measure=1, measure_steps=2, json=False, quiet=False)

    def replan(lowered: float) -> AutoPlan:
        return search(_CONFIG, dataclasses.replace(plan.request, memory_limit=lowered), _costs, _HW)

    winner, runs = _measured_winner(plan, args, "llama-tiny", replan)
    out = capsys.readouterr()
    assert len(rounds) == 2 and len(runs) == 2
    assert plan.winner is not None and rounds[0] == [plan.winner]
    assert plan.winner.peak_bytes + over > limit
    # The second round's candidates were planned under limit - over: they fit as measured.
    assert winner is not None and winner in rounds[1]
    assert winner.peak_bytes + over <= limit
    assert "planning again under" in out.err + out.out
    assert "the predicted winner is kept" not in out.out
