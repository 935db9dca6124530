"""Metrics: JSONL lines, progress output on and off a terminal, summary, bubble."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest

from pipetrain.schedules import Action, Kind
from pipetrain.schedules.execution import Event, Timeline
from pipetrain.train.metrics import (
    MetricsError,
    MetricsFile,
    Progress,
    RunOutput,
    RunSummary,
    draw_timeline,
    format_duration,
    measured_bubble,
    peak_memory_bytes,
    reset_peak_memory,
)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_metrics_file_is_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "m.jsonl"
    metrics = MetricsFile(path)
    metrics.write({"step": 0, "loss": 5.5, "grad_norm": math.nan})
    metrics.write({"step": 1, "eval_loss": 4.0})
    # Lines are on disk before close: a crashed run keeps them.
    assert len(path.read_text().splitlines()) == 2
    metrics.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 0, "loss": 5.5, "grad_norm": None}, {"step": 1, "eval_loss": 4.0}]


def test_unwritable_metrics_path_names_the_field(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(MetricsError, match=r"run.metrics .* cannot be written"):
        MetricsFile(blocker / "m.jsonl")


def test_plain_lines_off_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(3, out)
    for step in range(3):
        progress.update(step, loss=2.0 - step, tokens_per_s=1000.0, elapsed_s=step + 1.0)
    progress.message("eval loss 1.0")
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/3  loss 2.0000  1,000 tok/s  ETA 0:02"
    assert lines[2] == "step 3/3  loss 0.0000  1,000 tok/s  ETA 0:00"
    assert lines[3] == "eval loss 1.0"
    assert "\r" not in out.getvalue()


def test_plain_lines_are_thinned_for_long_runs() -> None:
    out = io.StringIO()
    progress = Progress(1000, out)
    for step in range(1000):
        progress.update(step, loss=1.0, tokens_per_s=1.0, elapsed_s=1.0)
    assert len(out.getvalue().splitlines()) == 100


def _steps(progress: Progress, count: int, *, first: int = 0) -> None:
    for step in range(first, first + count):
        progress.update(step, loss=2.0 - step, tokens_per_s=1000.0, elapsed_s=step + 1.0)


def test_a_terminal_gets_a_live_bar_with_the_lines_above_it() -> None:
    out = _Terminal()
    progress = Progress(3, out)
    progress.message("config: ...")
    progress.update(0, loss=3.0, tokens_per_s=1000.0, elapsed_s=5.0)
    progress.message("eval loss 1.0")
    progress.update(1, loss=2.0, tokens_per_s=1000.0, elapsed_s=10.0)
    progress.update(2, loss=1.0, tokens_per_s=1000.0, elapsed_s=15.0)
    progress.message("trained 3 steps")
    text = out.getvalue()
    # tqdm's bar, redrawn in place at every step, with the step, loss, tokens/s and ETA.
    assert text.startswith("config: ...\n\rstep 1/3 |")
    for done, loss, eta in ((1, "3.0000", "0:10"), (2, "2.0000", "0:05"), (3, "1.0000", "0:00")):
        assert f"\rstep {done}/3 |" in text
        assert f"| loss {loss}  1,000 tok/s  ETA {eta}" in text
    # No plain progress line: the bar is the progress.
    assert "step 1/3  loss" not in text
    # A line printed while the bar shows clears it, takes a line of its own, and the bar is
    # drawn again under it.
    assert "\reval loss 1.0\n\rstep 1/3 |" in text
    # The bar closed at the last step: the summary after it is on a line of its own.
    assert text.endswith("ETA 0:00\ntrained 3 steps\n")


def test_a_note_stays_above_the_bar() -> None:
    out = _Terminal()
    progress = Progress(4, out)
    progress.update(0, loss=3.0, tokens_per_s=10.0, elapsed_s=1.0)
    progress.update(1, loss=9.0, tokens_per_s=10.0, elapsed_s=2.0, note="skipped: nan")
    lines = out.getvalue().split("\n")
    assert any(
        line.endswith("\rstep 2/4  loss 9.0000  10 tok/s  ETA 0:02  skipped: nan") for line in lines
    )
    assert "\rstep 2/4 |" in out.getvalue()


def test_closing_ends_the_bar_of_a_run_that_stopped_early() -> None:
    # A failed run or one stopped by a signal: the error or the summary that follows must
    # not share the bar's line.
    out = _Terminal()
    progress = Progress(10, out)
    _steps(progress, 2)
    assert not out.getvalue().endswith("\n")
    progress.close()
    assert out.getvalue().endswith("\n")
    assert "\rstep 2/10 |" in out.getvalue()
    progress.close()  # again: nothing
    progress.message("stopped by signal SIGTERM")
    assert out.getvalue().endswith("ETA 0:08\nstopped by signal SIGTERM\n")


def test_the_output_closes_its_bar(tmp_path: Path) -> None:
    out = _Terminal()
    output = RunOutput(
        active=True,
        total_steps=5,
        stream=out,
        metrics_path=tmp_path / "m.jsonl",
        tensorboard_dir=None,
    )
    assert output.progress is not None
    _steps(output.progress, 1)
    output.close()
    assert out.getvalue().startswith("\rstep 1/5 |")
    assert out.getvalue().endswith("\n")


def test_a_resumed_runs_bar_starts_where_it_resumed() -> None:
    out = _Terminal()
    progress = Progress(10, out)
    # Resumed after 5 steps: step 5 (the 6th) took 2 s, so 4 left take 8 s.
    progress.update(5, loss=1.0, tokens_per_s=1.0, elapsed_s=2.0)
    assert out.getvalue().startswith("\rstep 6/10 |")
    assert "ETA 0:08" in out.getvalue()


@pytest.mark.parametrize("terminal", [False, True])
def test_plain_lines_are_the_same_off_a_terminal_and_with_the_bar_turned_off(
    terminal: bool,
) -> None:
    # Off a terminal (a file, a pipe, CI) nothing changes; run.progress_bar = false asks for
    # the same lines on a terminal.
    out = _Terminal() if terminal else io.StringIO()
    progress = Progress(3, out, bar=not terminal)
    progress.message("config: ...")
    _steps(progress, 2)
    progress.message("eval loss 1.0")
    _steps(progress, 1, first=2)
    progress.close()
    assert out.getvalue() == (
        "config: ...\n"
        "step 1/3  loss 2.0000  1,000 tok/s  ETA 0:02\n"
        "step 2/3  loss 1.0000  1,000 tok/s  ETA 0:01\n"
        "eval loss 1.0\n"
        "step 3/3  loss 0.0000  1,000 tok/s  ETA 0:00\n"
    )


def test_run_progress_bar_false_reaches_the_output(tmp_path: Path) -> None:
    from pipetrain.config import load_config
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.shared import open_output

    for value, bar in ((True, True), (False, False)):
        config = load_config(
            overrides={
                "run.name": "bar",
                "run.out_dir": str(tmp_path),
                "run.progress_bar": value,
            }
        )
        out = _Terminal()
        output = open_output(config, ProcessRole(), out)
        assert output.progress is not None
        _steps(output.progress, 1)
        output.close()
        assert ("|" in out.getvalue()) is bar, out.getvalue()


def test_format_duration() -> None:
    assert format_duration(75.2) == "1:15"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(math.nan) == "?"


def test_measured_bubble_of_a_two_rank_step() -> None:
    f0, f1 = Action(0, Kind.F, 0), Action(1, Kind.F, 0)
    b1, b0 = Action(1, Kind.B, 0), Action(0, Kind.B, 0)
    # Rank 0: F [0,1), B [3,5); rank 1: F [1,2), B [2,3). Makespan 5, busy 3 + 2.
    timeline = Timeline(
        "t", 2, (Event(0, f0, 0, 1), Event(1, f1, 1, 2), Event(1, b1, 2, 3), Event(0, b0, 3, 5))
    )
    assert measured_bubble(timeline) == pytest.approx(1 - 5 / 10)


def test_peak_memory_is_positive() -> None:
    assert peak_memory_bytes("cpu") > 10 * 2**20


def _touch(mib: int) -> None:
    block = bytearray(mib * 2**20)
    block[::4096] = b"\1" * len(block[::4096])  # every page resident
    del block


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
def test_peak_memory_is_the_runs_own_not_an_earlier_ones_nor_the_launchers() -> None:
    import subprocess
    import sys

    reset_peak_memory()
    before = peak_memory_bytes("cpu")
    _touch(400)
    assert peak_memory_bytes("cpu") > before + 300 * 2**20
    # A tuning candidate run in this process after a bigger one: its peak, not theirs.
    reset_peak_memory()
    assert peak_memory_bytes("cpu") < before + 200 * 2**20
    # A rank started from a process that was once larger (the launcher): its own peak.
    _touch(400)
    code = "from pipetrain.train.metrics import peak_memory_bytes as p; print(p('cpu'))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 300 * 2**20


def test_summary_text_and_json() -> None:
    summary = RunSummary(
        steps=80,
        wall_s=200.0,
        tokens=80 * 4096,
        tokens_per_s=1700.0,
        measured_bubble=0.31,
        simulated_bubble=0.2,
        first_eval_loss=5.5,
        final_eval_loss=2.2,
        peak_memory=(500 * 2**20, 400 * 2**20),
        skipped_steps=0,
    )
    text = summary.format()
    assert "1,700 tokens/s" in text
    assert "eval loss 5.5000 -> 2.2000 (60% lower)" in text
    assert "bubble: measured 31.0%, simulated 20.0%" in text
    assert "peak memory per rank: 500 MiB, 400 MiB" in text
    assert "tokens/s over the training steps after the first\n" in text
    # The debug mode's ranks share one process: one peak, not one per rank.
    shared = dataclasses.replace(summary, measured_bubble=None, peak_memory=(500 * 2**20,))
    assert "peak memory of the one process: 500 MiB" in shared.format()
    record = summary.to_json()
    assert record["summary"] is True and record["peak_memory"] == [500 * 2**20, 400 * 2**20]
    json.dumps(record)


@pytest.mark.parametrize(
    ("steps", "untimed", "said"),
    [
        (
            1,
            0,
            "tokens/s over its only step (allocations included: too few to leave the first out)",
        ),
        (2, 0, "tokens/s over all 2 steps (allocations included: too few to leave the first out)"),
        (6, 3, "tokens/s over the training steps after the first 3 (the first stream)"),
    ],
)
def test_summary_says_which_steps_its_tokens_per_second_counts(
    steps: int, untimed: int, said: str
) -> None:
    # A 1-step run (tune --steps 1, say) said "over the training steps after the first" of
    # a number that timed exactly that first step; a PipeDream run timed from its second
    # stream, not its second step.
    summary = RunSummary(
        steps, 1.0, 100, 50.0, None, None, math.nan, math.nan, (2**20,), 0, untimed
    )
    assert said in summary.format()
    assert summary.format().startswith(f"trained {steps} step{'' if steps == 1 else 's'}, ")


def test_eta_counts_only_the_steps_this_process_trained() -> None:
    out = io.StringIO()
    progress = Progress(10, out)
    # Resumed after 5 steps: step 5 (the 6th) took 2 s, so 4 left take 8 s.
    progress.update(5, loss=1.0, tokens_per_s=1.0, elapsed_s=2.0)
    assert out.getvalue().endswith("ETA 0:08\n")


def _failing_step_owner(schedule: str) -> object:
    if schedule == "pipedream":  # asynchronous: its own loop
        from pipetrain.train.pipedream.trainer import AsyncTrainer

        return AsyncTrainer
    from pipetrain.train import loop

    return loop


@pytest.mark.parametrize(("schedule", "method"), [("1f1b", "_step"), ("pipedream", "train_stream")])
def test_a_failed_run_still_closes_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: str, method: str
) -> None:
    # Ranks end with os._exit (pipetrain.launch.process_exit): a writer left open, as TensorBoard's
    # would be, loses what it buffered. The trainer closes its output when a step fails.
    from pipetrain.config import load_config
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.loop import train

    closed: list[bool] = []
    original_close = RunOutput.close

    def close(self: RunOutput) -> None:
        closed.append(True)
        original_close(self)

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("step failed")

    monkeypatch.setattr(RunOutput, "close", close)
    monkeypatch.setattr(_failing_step_owner(schedule), method, fail)
    config = load_config(
        overrides={
            "run.name": "fails",
            "run.out_dir": str(tmp_path),
            "run.steps": 4,
            "run.evaluate": False,
            "run.sample_tokens": 0,
            "model.name": "llama-tiny",
            "pipeline.pp": 2,
            "pipeline.single_process": True,
            "pipeline.schedule": schedule,
            "pipeline.microbatches": 2,
            "data.batch_size": 4,
            "data.seq_len": 16,
            "data.max_bytes": 100_000,
            "optim.warmup_steps": 1,
        }
    )
    with pytest.raises(RuntimeError, match="step failed"):
        train(config, ProcessRole(), out=io.StringIO())
    assert closed == [True]


def test_closing_the_output_twice_is_harmless(tmp_path: Path) -> None:
    output = RunOutput(
        active=True,
        total_steps=1,
        stream=io.StringIO(),
        metrics_path=tmp_path / "m.jsonl",
        tensorboard_dir=None,
    )
    output.report({"step": 0, "loss": 1.0})
    output.close()
    output.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1


def test_a_resumed_file_keeps_one_trajectory(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 0, "eval_loss": 5.0}\n', '{"step": 1, "loss": 4.0}\n']
    later = ['{"step": 2, "loss": 3.0}\n', '{"summary": true}\n', '{"step": 3, "lo']
    path.write_text("".join(lines + later))
    metrics = MetricsFile(path, append=True)
    note = metrics.resume_from(1)
    assert note is not None and "the 3 metrics records that the earlier attempt wrote" in note
    (aside,) = tmp_path.glob("metrics.superseded-*.jsonl")
    assert aside.read_text() == "".join(later) and path.read_text() == "".join(lines)
    metrics.write({"step": 2, "loss": 2.5})
    metrics.close()
    assert path.read_text().splitlines()[-1] == '{"step": 2, "loss": 2.5}'
    # Nothing past the step: nothing moves; a file written afresh is not touched at all.
    assert MetricsFile(path, append=True).resume_from(2) is None
    assert MetricsFile(path).resume_from(0) is None
    assert len(list(tmp_path.glob("metrics.superseded-*"))) == 1


def test_a_timeline_that_cannot_be_drawn_is_a_warning_not_a_failed_run(tmp_path: Path) -> None:
    # Found only after the last step (--timeline /proc/x.png passes the start's checks):
    # rank 0 failed with exit status 2, the sample was lost and rank 1 reported it lost.
    pytest.importorskip("matplotlib")
    f0, b0 = Action(0, Kind.F, 0), Action(0, Kind.B, 0)
    timeline = Timeline("t", 1, (Event(0, f0, 0.0, 0.01), Event(0, b0, 0.01, 0.03)))
    said: list[str] = []
    (tmp_path / "file").write_text("")
    draw_timeline(
        timeline, str(tmp_path / "file" / "x.png"), said.append, taking_turns=False, what="step"
    )
    assert len(said) == 1
    assert said[0].startswith("warning: the measured timeline of the last step was not drawn: ")
    assert "x.png" in said[0]
    draw_timeline(timeline, str(tmp_path / "x.png"), said.append, taking_turns=False, what="step")
    assert said[1] == f"measured timeline of the last step drawn to {tmp_path / 'x.png'}"
    assert (tmp_path / "x.png").stat().st_size > 0


def test_a_measured_timeline_can_be_written_as_a_chrome_trace(tmp_path: Path) -> None:
    # --timeline step.json: what Perfetto loads, a track per rank, seconds as microseconds.
    f0, f1 = Action(0, Kind.F, 0), Action(1, Kind.F, 0)
    timeline = Timeline("t", 2, (Event(0, f0, 0.0, 0.002), Event(1, f1, 0.002, 0.005)))
    said: list[str] = []
    path = tmp_path / "step.json"
    draw_timeline(timeline, str(path), said.append, taking_turns=False, what="step")
    assert said == [f"measured timeline of the last step written to {path}"]
    trace = json.loads(path.read_text())
    spans = [
        (e["tid"], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"
    ]
    assert spans == [
        (0, "0F0", 0.0, pytest.approx(2000.0)),
        (1, "1F0", 2000.0, pytest.approx(3000.0)),
    ]


@pytest.mark.parametrize("schedule", ["1f1b", "pipedream"])
def test_a_run_on_a_terminal_shows_the_bar_and_prints_the_rest_above_or_after_it(
    tmp_path: Path, schedule: str
) -> None:
    from pipetrain.config import load_config
    from pipetrain.launch.role import ProcessRole
    from pipetrain.train.loop import train

    config = load_config(
        overrides={
            "run.name": f"bar-{schedule}",
            "run.out_dir": str(tmp_path),
            "run.steps": 3,
            "run.sample_tokens": 0,
            "model.name": "llama-tiny",
            "pipeline.pp": 2,
            "pipeline.single_process": True,
            "pipeline.schedule": schedule,
            "pipeline.microbatches": 2,
            "data.batch_size": 4,
            "data.seq_len": 16,
            "data.max_bytes": 100_000,
            "optim.warmup_steps": 1,
        }
    )
    out = _Terminal()
    train(config, ProcessRole(), out=out)
    text = out.getvalue()
    for done in (1, 2, 3):
        assert f"\rstep {done}/3 |" in text
    assert "step 1/3  loss" not in text  # no plain progress line
    # The bar closed at the last step: the final evaluation and the summary follow it on
    # lines of their own.
    after = text[text.rindex("\rstep 3/3 |") :]
    assert "\neval loss after 3 steps: " in after
    assert "\ntrained 3 steps, " in after
    assert text.endswith("\n")
