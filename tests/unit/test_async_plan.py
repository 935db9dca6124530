"""Settings of asynchronous runs: stream length, and what is rejected before any launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipetrain.config import ConfigError, TrainConfig, load_config
from pipetrain.train.pipedream.plan import stream_steps_for
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
