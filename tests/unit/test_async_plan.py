"""Settings and reports of asynchronous runs: stream length (periods past the end of the run
cut no streams), what is rejected before any launch, the simulated bubble replayed from
the measured times (optimizer steps included), and the weight-versions line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipetrain.config import ConfigError, TrainConfig, load_config
from pipetrain.runtime.timeline import measured_costs, simulated_bubble
from pipetrain.schedules import Kind
from pipetrain.schedules.execution import Costs
from pipetrain.sim import simulate
from pipetrain.train.pipedream.plan import async_schedule, stream_steps_for
from pipetrain.train.plan import plan_run


def _config(**overrides: Any) -> TrainConfig:
    return load_config(
        overrides={
            "run.name": "t",
            "run.steps": 12,
            "optim.warmup_steps": 1,
            "run.eval_every": 0,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        ({}, 12),  # no evaluation or save inside the run: one stream
        ({"run.eval_every": 4}, 4),
        ({"run.eval_every": 6, "run.checkpoint_every": 4, "run.checkpoint_dir": "c"}, 2),
        ({"run.eval_every": 5, "run.evaluate": False}, 12),
        ({"pipeline.stream_steps": 3}, 3),
    ],
)
def test_stream_steps(overrides: dict[str, Any], steps: int) -> None:
    assert stream_steps_for(_config(**overrides)) == steps


def test_async_schedules_plan() -> None:
    for name in ("pipedream", "pipedream-2bw"):
        plan = plan_run(_config(**{"pipeline.schedule": name}), vocab_size=256)
        assert plan.schedule.asynchronous
    plan_run(
        _config(**{"pipeline.schedule": "pipedream", "pipeline.vertical_sync": True}),
        vocab_size=256,
    )


REJECTED: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"pipeline.vertical_sync": True}, ("pipeline.vertical_sync", "drop --vertical-sync")),
    ({"pipeline.stream_steps": 2}, ("pipeline.stream_steps", "drop --stream-steps")),
    (
        {"pipeline.schedule": "pipedream-2bw", "pipeline.vertical_sync": True},
        ("already gives every stage", "drop --vertical-sync"),
    ),
    ({"pipeline.schedule": "pipedream", "pipeline.dp": 2}, ("pipeline.dp 2", "--dp 1")),
    ({"pipeline.schedule": "pipedream", "pipeline.recompute": True}, ("drop --recompute",)),
    (
        {"pipeline.schedule": "pipedream", "pipeline.recompute_ranks": "0"},
        ("drop --recompute-ranks",),
    ),
    (
        {"pipeline.schedule": "pipedream-2bw", "pipeline.precision": "bf16"},
        ("drop --precision bf16",),
    ),
    (
        {"pipeline.schedule": "pipedream", "pipeline.stream_steps": 5},
        ("run.steps 12", "multiple of pipeline.stream_steps 5", "--steps 10"),
    ),
    (
        {"pipeline.schedule": "pipedream", "pipeline.stream_steps": 4, "run.eval_every": 6},
        ("run.eval_every 6", "multiple of 4"),
    ),
    (
        {"pipeline.schedule": "pipedream-2bw", "pipeline.microbatches": 2, "data.batch_size": 8},
        ("pipeline:", "--microbatches", "a stream is 12 steps"),
    ),
]


@pytest.mark.parametrize(("overrides", "words"), REJECTED, ids=[str(o) for o, _ in REJECTED])
def test_rejected_before_launch(overrides: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        plan_run(_config(**overrides), vocab_size=256)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_a_whole_run_stream_with_checkpoints_says_a_stop_would_save_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop signal is obeyed between streams only: with one stream for the whole run the
    # user is told how to get streams to stop and save between (the run itself is cut
    # short here once the note is out).
    import io

    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.loop import train
    from pipetrain.train.pipedream.trainer import AsyncTrainer

    def stop(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stopped after the set-up")

    monkeypatch.setattr(AsyncTrainer, "train_stream", stop)
    out = io.StringIO()
    overrides = {
        "run.out_dir": str(tmp_path),
        "run.evaluate": False,
        "run.sample_tokens": 0,
        "run.checkpoint_dir": str(tmp_path / "ck"),
        "model.name": "llama-tiny",
        "pipeline.pp": 2,
        "pipeline.single_process": True,
        "pipeline.schedule": "pipedream",
        "pipeline.microbatches": 2,
        "data.batch_size": 4,
        "data.seq_len": 16,
        "data.max_bytes": 100_000,
    }
    with pytest.raises(RuntimeError, match="stopped after the set-up"):
        train(_config(**overrides), ProcessRole(), out=out)
    assert "note: one stream is the whole run" in out.getvalue()
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="stopped after the set-up"):
        train(_config(**overrides, **{"run.checkpoint_every": 4}), ProcessRole(), out=out)
    assert "note: one stream" not in out.getvalue()


def _async_config(**overrides: object) -> TrainConfig:
    return load_config(
        overrides={
            "run.name": "t",
            "run.steps": 12,
            "optim.warmup_steps": 1,
            "pipeline.schedule": "pipedream",
            "data.seq_len": 16,
            **overrides,
        }
    )


@pytest.mark.parametrize(
    ("overrides", "stream"),
    [
        ({}, 12),  # the default eval_every (40) is past the end: streams of 4 were cut for it
        ({"run.eval_every": 12}, 12),
        ({"run.checkpoint_every": 20, "run.checkpoint_dir": "c"}, 12),
        ({"run.eval_every": 40, "run.checkpoint_every": 8, "run.checkpoint_dir": "c"}, 4),
    ],
)
def test_periods_past_the_run_do_not_cut_streams(overrides: dict[str, object], stream: int) -> None:
    assert stream_steps_for(_async_config(**overrides)) == stream


def test_stream_steps_are_not_refused_for_an_evaluation_past_the_run() -> None:
    # --steps 12 --stream-steps 3 was refused: "run.eval_every 40 does not fall between
    # streams", for an evaluation the run never makes.
    plan = plan_run(_async_config(**{"pipeline.stream_steps": 3}), vocab_size=256)
    assert plan.schedule.asynchronous
    with pytest.raises(ConfigError, match=r"run\.eval_every 6 does not fall between streams"):
        plan_run(_async_config(**{"pipeline.stream_steps": 4, "run.eval_every": 6}), vocab_size=256)


def test_tied_embeddings_are_refused_before_launch() -> None:
    # Each rank found them after the launch and printed the error, with the launcher's lines.
    config = _async_config(**{"model.name": "gpt2-tiny", "pipeline.pp": 2})
    with pytest.raises(ConfigError, match=r"model\.name gpt2-tiny: its tied embeddings"):
        plan_run(config, vocab_size=256)
    plan_run(_async_config(**{"model.name": "gpt2-tiny", "pipeline.pp": 1}), vocab_size=256)


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
def test_replay_of_an_async_run_keeps_its_optimizer_steps(name: str) -> None:
    # A "measured" run that is exactly the simulator's, with optimizer steps that take time:
    # its replay must give back the same bubble (the steps were once costed at 0).
    schedule = async_schedule(name, 2, 4, 2)
    costs = Costs(forward=(1.0, 1.5), backward=(2.0, 3.0), step=0.75)
    run = simulate(schedule, costs)
    assert any(e.action.kind is Kind.STEP for e in run.timeline.events)
    assert measured_costs(run.timeline, schedule).step == 0.75
    got = simulated_bubble([run.timeline, run.timeline], schedule)
    assert got == pytest.approx(run.bubble.idle_fraction)


def test_no_measured_run_has_no_simulated_bubble() -> None:
    assert simulated_bubble([], async_schedule("pipedream", 2, 2, 1)) is None


def test_versions_line_says_where_the_simulator_counts_otherwise() -> None:
    from pipetrain.train.pipedream.loop import versions_line

    # 2BW keeps two versions on the last stage too; the simulator's [2, 1] was printed next
    # to the run's [2, 2] as if one of them were wrong.
    line = versions_line("pipedream-2bw", (2, 2), (2, 1), vertical_sync=False)
    assert line == (
        "weight versions per rank: at most [2, 2] alive at once (simulator, whose forwards "
        "take the newest version, not the previous window's: [2, 1])"
    )
    assert versions_line("pipedream", (2, 1), (2, 1), vertical_sync=False).endswith(
        "(simulator: [2, 1])"
    )
    assert "which has no vertical sync" in versions_line(
        "pipedream", (2, 2), (2, 1), vertical_sync=True
    )
