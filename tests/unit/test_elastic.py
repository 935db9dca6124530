"""``fit_world``: a resumed run on another number of processes, re-planned."""

from __future__ import annotations

import pytest

from pipetrain.config import ConfigError, TrainConfig, load_config
from pipetrain.config.elastic import fit_world


def _config(**overrides: object) -> TrainConfig:
    base = {"run.name": "t", "run.resume": True, "run.checkpoint_dir": "ckpt"}
    return load_config(None, {**base, **overrides}, check_paths=False)


def test_fewer_processes_keep_pp_and_the_rows_of_a_micro_batch() -> None:
    config = _config(**{"pipeline.pp": 2, "pipeline.dp": 2, "pipeline.microbatches": 4})
    refit = fit_world(config, 2)
    p = refit.config.pipeline
    assert (p.pp, p.dp, p.microbatches) == (2, 1, 8)  # 32 rows: 8 micro-batches of 4
    assert refit.config.data == config.data  # the same global batch
    assert refit.note == (
        "elastic: 2 processes continue this run of pp 2 x dp 2 (4 processes): re-planned as "
        "pp 2 x dp 1, 8 micro-batches of 4 rows per replica (was 4 of 4), the same global "
        "batch of 32 rows; the checkpoint is resharded as it loads"
    )


def test_a_pipeline_longer_than_the_processes_is_shortened() -> None:
    config = _config(**{"pipeline.pp": 4, "pipeline.split": "3,3,3,3"})
    refit = fit_world(config, 2)
    p = refit.config.pipeline
    assert (p.pp, p.dp, p.microbatches, p.split) == (2, 1, 8, "")
    assert refit.note.endswith("; dropped --split 3,3,3,3 (blocks by --balance now)")


def test_sharded_replicas_down_to_one_stop_sharding() -> None:
    config = _config(**{"pipeline.pp": 2, "pipeline.dp": 2, "pipeline.shard": True})
    refit = fit_world(config, 2)
    assert not refit.config.pipeline.shard
    assert "dropped --shard (one replica)" in refit.note


def test_the_same_processes_or_no_resume_change_nothing() -> None:
    config = _config(**{"pipeline.pp": 2, "pipeline.dp": 2})
    assert fit_world(config, 4).config is config and fit_world(config, 4).note == ""
    fresh = _config(**{"pipeline.pp": 2, "pipeline.dp": 2, "run.resume": False})
    assert fit_world(fresh, 2).config is fresh  # a new run says what it wants (loop._set_up)


def test_processes_that_tp_does_not_divide_are_refused() -> None:
    config = _config(**{"pipeline.pp": 2, "pipeline.tp": 2, "model.name": "llama-tiny"})
    with pytest.raises(ConfigError, match="tp 2 does not divide them"):
        fit_world(config, 3)


def test_a_schedule_file_is_not_re_planned() -> None:
    config = _config(**{"pipeline.pp": 2, "pipeline.dp": 2, "pipeline.schedule": "mine.csv"})
    with pytest.raises(ConfigError, match="which fixes its ranks: start 4 processes"):
        fit_world(config, 2)
