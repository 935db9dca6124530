"""A schedule file as pipeline.schedule: the run's plan loads it, and a file that cannot run
with the settings is one ConfigError naming the setting to change, before any launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipetrain.config import ConfigError, load_config
from pipetrain.schedules import io, registry
from pipetrain.train.plan import RunPlan, is_schedule_file, plan_run

TINY = {"model.name": "llama-tiny", "data.seq_len": 32, "data.batch_size": 8}


def _plan(**overrides: Any) -> RunPlan:
    config = load_config(overrides={"run.name": "t", **TINY, **overrides})
    return plan_run(config, vocab_size=256)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("schedules")
    saved = {
        "zb.csv": registry.build_schedule("zb-h1", 2, 4),
        "zb.JSON": registry.build_schedule("zb-h1", 2, 4),
        "v.csv": registry.build_schedule("zb-v", 2, 4),
        "stream.json": registry.build_schedule("pipedream", 2, 4),
    }
    for name, schedule in saved.items():
        (io.dump_json if name.lower().endswith(".json") else io.dump_csv)(schedule, folder / name)
    return {name: folder / name for name in saved}


def test_a_file_is_the_schedule_it_was_saved_from(files: dict[str, Path]) -> None:
    assert is_schedule_file("mine.CSV") and not is_schedule_file("zb-h1")
    for name, builtin in (("zb.csv", "zb-h1"), ("zb.JSON", "zb-h1"), ("v.csv", "zb-v")):
        plan = _plan(**{"pipeline.pp": 2, "pipeline.microbatches": 4},
                     **{"pipeline.schedule": str(files[name])})  # fmt: skip
        built = _plan(**{"pipeline.pp": 2, "pipeline.microbatches": 4},
                      **{"pipeline.schedule": builtin})  # fmt: skip
        assert plan.schedule.actions == built.schedule.actions, name
        assert plan.schedule.placement == built.schedule.placement, name
        assert plan.split == built.split, name


@pytest.mark.parametrize(
    ("name", "overrides", "fragments"),
    [
        ("zb.csv", {"pipeline.microbatches": 8}, ("not the 8 asked for", "--microbatches 4")),
        ("zb.JSON", {"pipeline.microbatches": 8}, ("not the 8 of", "use --microbatches 4")),
        ("zb.csv", {"pipeline.pp": 3}, ("2 rows but 3 ranks",)),
        ("zb.JSON", {"pipeline.pp": 3}, ("is for pp=2 but 3 ranks",)),
        ("zb.csv", {"pipeline.chunks": 2}, ("pipeline.chunks 2", "drop --chunks")),
        # pipedream streams 2 steps of 4: 8 micro-batches in the file.
        ("stream.json", {"pipeline.microbatches": 8}, ("is asynchronous", "--schedule pipedream")),
        ("zb.csv", {"pipeline.stream_steps": 2}, ("pipeline.stream_steps", "drop --stream-steps")),
        ("missing.csv", {}, ("cannot read schedule file", "check the path")),
    ],
)
def test_a_file_that_cannot_run_is_one_config_error(
    files: dict[str, Path], name: str, overrides: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    path = files.get(name, Path(name))
    settings = {"pipeline.pp": 2, "pipeline.microbatches": 4, **overrides}
    with pytest.raises(ConfigError) as info:
        _plan(**settings, **{"pipeline.schedule": str(path)})
    message = str(info.value)
    assert "\n" not in message and message.startswith("pipeline."), message
    for fragment in fragments:
        assert fragment in message, message


def test_an_unknown_name_mentions_files() -> None:
    with pytest.raises(ConfigError, match=r"or give a schedule file ending in \.csv or \.json"):
        _plan(**{"pipeline.schedule": "1f1x"})


def test_home_in_a_schedule_file_is_expanded_as_in_other_paths() -> None:
    # A TOML file or a quoted --set goes through no shell.
    config = load_config(overrides={"pipeline.schedule": "~/mine.csv"})
    assert config.pipeline.schedule == str(Path.home() / "mine.csv")
    assert load_config(overrides={"pipeline.schedule": "zb-h1"}).pipeline.schedule == "zb-h1"
