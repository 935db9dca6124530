"""``--microbatches auto``: the counts it tries, the one it keeps, what it refuses, and a
run that probes trains exactly like one with a fixed count."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from pipetrain.config import ConfigError, load_config
from pipetrain.train.microbatch_counts import choose, nearest_counts
from pipetrain.train.plan import plan_run

AUTO = {"pipeline.microbatches_auto": True}


def _tried(overrides: dict[str, Any]) -> list[int]:
    """The counts a run of ``overrides`` (with --microbatches auto) tries, in order."""
    plan = plan_run(load_config(None, {**AUTO, **overrides}, check_paths=False), vocab_size=256)
    return [c.schedule.microbatches for c in plan.candidates]


def test_nearest_counts_on_a_log_scale() -> None:
    assert nearest_counts(8, [1, 2, 4, 8, 16, 32, 64]) == [8, 4, 16, 2, 32]
    assert nearest_counts(4, [1, 2, 4, 8], most=2) == [4, 2]
    assert nearest_counts(3, [1, 2, 3, 6], most=0) == [3, 2, 6, 1]


def test_the_fastest_count_wins_ties_keep_the_configured_one() -> None:
    assert choose({4: 0.51, 8: 0.47, 16: 0.49}, start=4) == 8
    assert choose({4: 0.5, 8: 0.5, 2: 0.5}, start=8) == 8
    assert choose({4: 0.5, 16: 0.5}, start=8) == 4


@pytest.mark.parametrize(
    ("overrides", "counts"),
    [
        # 1F1B takes m >= pp: 1 and 2 are not tried on 4 ranks; the configured 8 first.
        ({"pipeline.pp": 4}, [8, 4, 16, 32]),
        # Five counts at most, nearest the configured 8: 2, 4, 16, 32 (not 1, 64, 128).
        ({"pipeline.pp": 2, "data.batch_size": 128}, [8, 2, 4, 16, 32]),
        # Each replica splits its own 16 rows.
        ({"pipeline.pp": 2, "pipeline.dp": 2, "pipeline.microbatches": 4}, [4, 2, 8, 16]),
        # zb-h2's own rule (m >= 2 x pp - 1) comes from its own check: 4 and 6 are not tried.
        (
            {"pipeline.pp": 4, "pipeline.schedule": "zb-h2", "data.batch_size": 48},
            [8, 12, 16, 24, 48],
        ),
    ],
)
def test_candidates_are_the_counts_the_schedule_and_batch_allow(
    overrides: dict[str, Any], counts: list[int]
) -> None:
    assert _tried(overrides) == counts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pipeline.schedule": "pipedream", "pipeline.pp": 2}, "pipedream is asynchronous"),
        ({"pipeline.schedule": "naive", "pipeline.pp": 2}, "runs the whole batch as 1"),
        ({"pipeline.compile": True, "pipeline.pp": 2}, "drop --compile"),
        (
            {"pipeline.pp": 1, "pipeline.dp": 2, "data.batch_size": 2, "pipeline.microbatches": 1},
            "the per-replica batch of 1 sample (data.batch_size 2 over pipeline.dp 2) allows "
            "only 1 micro-batch",
        ),
        (
            {"pipeline.pp": 4, "data.batch_size": 4, "pipeline.microbatches": 4},
            "takes only 4 micro-batches",
        ),
    ],
)
def test_what_cannot_choose_is_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _tried(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith("pipeline.microbatches_auto (--microbatches auto): ")


def test_a_schedule_file_is_refused(tmp_path: Path) -> None:
    from pipetrain.schedules.io import dump_csv
    from pipetrain.schedules.registry import build_schedule

    path = tmp_path / "mine.csv"
    dump_csv(build_schedule("1f1b", 2, 8), path)
    with pytest.raises(ConfigError, match="fixes its 8 micro-batches"):
        _tried({"pipeline.pp": 2, "pipeline.schedule": str(path)})


def test_auto_in_a_config_file_keeps_the_count_an_int(tmp_path: Path) -> None:
    path = tmp_path / "auto.toml"
    path.write_text('[pipeline]\nmicrobatches = "auto"\n')
    config = load_config(path, check_paths=False)
    assert (config.pipeline.microbatches, config.pipeline.microbatches_auto) == (8, True)
    # --microbatches auto on top of a file's count starts from that count.
    path.write_text("[pipeline]\nmicrobatches = 4\n")
    config = load_config(path, {"pipeline.microbatches": "auto"}, check_paths=False)
    assert (config.pipeline.microbatches, config.pipeline.microbatches_auto) == (4, True)
    # A start that does not divide the per-replica batch (the default 8 of 8 rows over 2
    # replicas) is where the probe starts, not a request: the largest count that fits.
    notes: list[str] = []
    auto = {**AUTO, "pipeline.dp": 2, "data.batch_size": 8}
    assert load_config(None, auto, check_paths=False, notes=notes).pipeline.microbatches == 4
    assert notes == [
        "note: --microbatches auto starts from 4 micro-batches: 8 does not divide the "
        "per-replica batch of 4"
    ]


def _train(tmp_path: Path, name: str, **overrides: Any) -> tuple[list[dict[str, Any]], str]:
    """A tiny 2-stage run in this process (the debug mode): its metrics records, its output."""
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.loop import train

    config = load_config(
        overrides={
            "run.name": name,
            "run.out_dir": str(tmp_path),
            "run.steps": 8,
            "run.sample_tokens": 0,
            "model.name": "llama-tiny",
            "pipeline.pp": 2,
            "pipeline.single_process": True,
            "pipeline.threads": 1,
            "data.batch_size": 8,
            "data.seq_len": 16,
            "data.max_bytes": 100_000,
            "data.eval_batches": 1,
            "optim.warmup_steps": 1,
            **overrides,
        }
    )
    out = io.StringIO()
    train(config, ProcessRole(), out=out)
    records = [json.loads(line) for line in config.metrics_path.read_text().splitlines()]
    return records, out.getvalue()


def test_a_probing_run_trains_like_a_fixed_count(tmp_path: Path) -> None:
    auto, said = _train(tmp_path, "auto", **{"pipeline.microbatches": 4, **AUTO})
    fixed, _ = _train(tmp_path, "fixed", **{"pipeline.microbatches": 4})
    steps = [r for r in auto if "loss" in r]
    # 2 steps each of 4, 2 and 8 micro-batches (1 is refused by 1F1B on 2 ranks), then the choice.
    assert [r["microbatches"] for r in steps[:6]] == [4, 4, 2, 2, 8, 8]
    (decision,) = [r["microbatches_auto"] for r in auto if "microbatches_auto" in r]
    assert sorted(decision["tried"]) == ["2", "4", "8"] and decision["steps"] == [1, 6]
    assert f"training on with {decision['chosen']} micro-batches" in said
    assert {r["microbatches"] for r in steps[6:]} == {decision["chosen"]}
    assert auto[-1]["summary"] and auto[-1]["microbatches"] == decision["chosen"]
    # The loss of a step does not depend on the count: the same as the fixed run's, step
    # by step (as the e2e equality tests compare), and so is the evaluation.
    want = {r["step"]: r["loss"] for r in fixed if "loss" in r}
    assert {r["step"] for r in steps} == set(want)
    for r in steps:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-5), r["step"]
    evals = [r["eval_loss"] for r in auto if "eval_loss" in r]
    assert evals == pytest.approx([r["eval_loss"] for r in fixed if "eval_loss" in r], rel=1e-5)


def test_a_run_too_short_to_probe_keeps_the_count(tmp_path: Path) -> None:
    records, said = _train(
        tmp_path, "short", **{"pipeline.microbatches": 4, **AUTO, "run.steps": 6}
    )
    assert not any("microbatches_auto" in r for r in records)
    assert "6 steps left, but trying 3 counts takes 6 and one to train on" in said
    assert {r["microbatches"] for r in records if "loss" in r} == {4}
