"""Recomputation on some pipeline ranks only: the planner's split gives those ranks fewer
blocks, charges them recomputation's time and bytes, and under a budget that the first
ranks alone break it recomputes there only (no processes here)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.cli.plan_auto import HARDWARE, _write, auto_overrides
from pipetrain.config import ConfigError, load_config
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import AutoRequest, search
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layouts import Layout
from pipetrain.partition.memory import recompute_costs
from pipetrain.partition.recompute_ranks import recompute_speeds, recomputed_on
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.stages import split_for

HW = replace(HARDWARE["cpu"], shared_cores=0.0)
SEQ = 64
CONFIG = get_model_config("llama-default")


def _costs(tp: int, mb: int = 1):
    return estimate_costs(CONFIG, SEQ, flops_per_second=HW.flops, tp=tp)


def test_a_recomputing_rank_runs_slower_by_its_blocks_forward_and_keeps_their_inputs() -> None:
    plain = _costs(1)
    again = recompute_costs(plain, 4.0 * SEQ * CONFIG.d_model)
    speeds = recompute_speeds(plain, again, {0, 2}, 4)
    blocks = [i for i, c in enumerate(plain) if c.kind == "block"]
    want = sum(plain[i].time for i in blocks) / sum(again[i].time for i in blocks)
    assert speeds == [pytest.approx(want), 1.0, pytest.approx(want), 1.0] and want < 1
    partition = split_for("cost", plain, ((0,), (1,), (2,), (3,)), None, None, speeds)
    mixed = recomputed_on(partition, again, {0})
    full = recomputed_on(partition, again, {0, 1, 2, 3})
    assert mixed.forward == partition.forward and mixed.params == partition.params
    assert mixed.backward[0] == full.backward[0] > partition.backward[0]
    assert mixed.backward[1:] == partition.backward[1:]
    assert mixed.activation_bytes_per_sample[0] < partition.activation_bytes_per_sample[0]
    assert mixed.activation_bytes_per_sample[1:] == partition.activation_bytes_per_sample[1:]


def test_the_scorer_charges_the_recomputing_ranks_only_and_gives_them_fewer_blocks() -> None:
    scorer = Scorer(CONFIG, AutoRequest(4, 8, SEQ), _costs, HW)
    plain = scorer.evaluate(Layout("1f1b", 4, 1, 1, 1, 8, False, False))
    full = scorer.evaluate(Layout("1f1b", 4, 1, 1, 1, 8, True, False))
    first = scorer.evaluate(Layout("1f1b", 4, 1, 1, 1, 8, False, False, recompute_ranks=(0,)))
    assert plain.step_time < first.step_time < full.step_time
    assert first.split[0] < plain.split[0]  # the recomputing rank: fewer blocks
    assert first.memory[0].total < plain.memory[0].total
    assert first.memory[0].transient > 0 and all(m.transient == 0 for m in first.memory[1:])
    assert first.memory[1].activations >= plain.memory[1].activations  # no saving there


def test_naive_model_parallel_recomputes_and_sends_the_whole_batch_at_once() -> None:
    # Naive's one backward of a rank runs the whole batch: its recomputed block and its
    # messages hold every sample, however many micro-batches the batch is counted as.
    scorer = Scorer(CONFIG, AutoRequest(2, 8, SEQ), _costs, HW)
    one, four = (scorer.evaluate(Layout("naive", 2, 1, 1, 1, m, True, False)) for m in (1, 4))
    piped = scorer.evaluate(Layout("1f1b", 2, 1, 1, 1, 4, True, False))
    for r in range(2):
        assert one.memory[r].transient > 0 and one.memory[r].buffers > 0
        assert four.memory[r].transient == pytest.approx(one.memory[r].transient)
        assert four.memory[r].transient == pytest.approx(4 * piped.memory[r].transient)
        assert four.memory[r].buffers == pytest.approx(one.memory[r].buffers)
        assert four.memory[r].buffers == pytest.approx(4 * piped.memory[r].buffers)


def test_a_budget_the_first_ranks_break_is_met_by_recomputing_there_only(
    tmp_path: Path,
) -> None:
    req = AutoRequest(4, 8, SEQ, top=5, schedules=("1f1b",), max_tp=1)
    free = search(CONFIG, req, _costs, HW)
    plan = search(CONFIG, replace(req, memory_limit=0.8 * free.winner.peak_bytes), _costs, HW)
    win = plan.winner
    assert win is not None and win.layout.recompute_ranks and not win.layout.recompute
    assert len(win.layout.recompute_ranks) < win.layout.pp and win.fits
    every = Scorer(CONFIG, plan.request, _costs, HW).evaluate(
        replace(win.layout, recompute=True, recompute_ranks=())
    )
    assert every is not None and win.step_time < every.step_time
    fields = auto_overrides(win, plan.request)
    assert fields["pipeline.recompute_ranks"] == ",".join(map(str, win.layout.recompute_ranks))
    out = tmp_path / "auto.toml"
    _write(out, "llama-default", win, plan.request)
    assert load_config(out).pipeline.recomputing_ranks == frozenset(win.layout.recompute_ranks)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"pipeline.pp": 2, "pipeline.recompute_ranks": "2"}, "names rank 2, but pipeline.pp"),
        ({"pipeline.pp": 2, "pipeline.recompute_ranks": "0,0"}, "give distinct pipeline ranks"),
        ({"pipeline.pp": 2, "pipeline.recompute_ranks": "a"}, "give distinct pipeline ranks"),
        (
            {"pipeline.pp": 2, "pipeline.recompute_ranks": "0", "pipeline.recompute": True},
            "drop one of --recompute and --recompute-ranks",
        ),
    ],
)
def test_bad_recompute_ranks_are_one_line(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, fields, check_paths=False)
    ok = load_config(
        None, {"pipeline.pp": 3, "pipeline.recompute_ranks": "0, 2"}, check_paths=False
    )
    assert ok.pipeline.recomputing_ranks == frozenset({0, 2})
