"""The trainer's reports of an asynchronous run: measured costs and the simulated bubble."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.runtime.timeline import measured_costs, simulated_bubble
from pipetrain.schedules import Kind
from pipetrain.schedules.execution import Costs
from pipetrain.sim import simulate
from pipetrain.train.async_plan import async_schedule
from pipetrain.train.config import ConfigError, load_config


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


def test_a_timeline_path_that_is_a_folder_is_refused_before_training(tmp_path: Path) -> None:
    # It was found only when the picture was drawn, after the last step.
    folder = tmp_path / "step.png"
    folder.mkdir()
    overrides = {"run.out_dir": str(tmp_path / "runs"), "run.timeline": str(folder)}
    with pytest.raises(ConfigError, match=r"run.timeline .* is a folder: name a .png file"):
        load_config(overrides=overrides)
