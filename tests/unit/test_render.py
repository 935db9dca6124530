"""Pictures of hand-built timelines: ASCII golden output, trace structure, PNG/SVG files;
the ASCII grid squeezed within the width of a terminal, and pictures and traces that
cannot be written refused in one line."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from test_sim_metrics import GPIPE_2_2, ONE_F_ONE_B_2_2, PIPEDREAM_2, timeline

from pipetrain.errors import InputError
from pipetrain.schedules import registry
from pipetrain.schedules.actions import Kind
from pipetrain.schedules.execution import Costs, Event, Timeline, replay
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import build_schedule
from pipetrain.sim.data_parallel import data_parallel_cost, sharded_cost
from pipetrain.sim.render import (
    RenderError,
    chrome_trace,
    plot,
    plot_compare,
    text_grid,
    transfers,
    write_chrome_trace,
)
from pipetrain.sim.simulator import SimResult, simulate


def test_ascii_gpipe_golden() -> None:
    assert text_grid(GPIPE_2_2) == (
        "t: 2 ranks, makespan 9\n"
        " t| 0       2       4       6       8\n"
        "r0| 0F0 0F1 ............0B0---- 0B1---- \n"
        "r1| ....1F0 1F1 1B0---- 1B1---- ........"
    )


def test_ascii_squeezes_to_the_width_and_keeps_short_labels() -> None:
    text = text_grid(PIPEDREAM_2, width=40)
    rows = text.splitlines()[2:]
    assert all(len(row) <= 40 for row in rows)
    # Two characters per unit: every F box is "F3", every B box "B3- ".
    assert rows[0] == "r0| F0F1....B0- F2B1- F3B2- ..B3- "
    assert "B3" in rows[1]
    # Zero-length steps are not drawn; the two ranks' rows have the same length.
    assert "STEP" not in text
    assert len(rows[0]) == len(rows[1])


def test_ascii_shows_idle_between_boxes_and_skips_communication() -> None:
    tl = timeline(["0F0@0-1 0SEND_F0@1-1 0B0@4-6", "1RECV_F0@1-1 1F0@1-2 1B0@2-4"])
    rows = text_grid(tl).splitlines()[2:]
    assert rows[0] == "r0| 0F0 ............0B0---- "
    assert rows[1] == "r1| ....1F0 1B0---- ........"


def test_ascii_of_an_empty_timeline() -> None:
    assert text_grid(Timeline("none", 2, ())) == "none: 2 ranks, makespan 0\n(no work)"


def test_chrome_trace_has_one_track_per_rank_and_complete_events() -> None:
    trace = chrome_trace([GPIPE_2_2, ONE_F_ONE_B_2_2], us_per_unit=10.0)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(GPIPE_2_2.events) + len(ONE_F_ONE_B_2_2.events)
    assert {(e["pid"], e["tid"]) for e in complete} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(1, 1)] == "rank 1"
    b0 = next(e for e in complete if e["pid"] == 0 and e["name"] == "0B0")
    assert (b0["ts"], b0["dur"]) == (50.0, 20.0)
    assert b0["args"] == {"stage": 0, "kind": "B", "microbatch": 0}
    assert b0["cat"] == "compute"
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == 1]
    rank0 = [(e["ts"], e["args"]["live"]) for e in counters if e["name"] == "activations rank 0"]
    assert rank0 == [(0.0, 1.0), (10.0, 2.0), (60.0, 1.0), (90.0, 0.0)]


def test_write_chrome_trace_round_trips_through_json(tmp_path: Path) -> None:
    path = write_chrome_trace(PIPEDREAM_2, tmp_path / "t.json")
    loaded = json.loads(path.read_text())
    steps = [e for e in loaded["traceEvents"] if e.get("cat") == "step"]
    assert len(steps) == 8
    assert loaded == chrome_trace(PIPEDREAM_2)


def test_plot_png_and_svg(tmp_path: Path) -> None:
    png = plot(GPIPE_2_2, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = plot_compare([GPIPE_2_2, ONE_F_ONE_B_2_2, PIPEDREAM_2], tmp_path / "c.svg")
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_plot_rejects_an_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"use a \.png or \.svg suffix"):
        plot(GPIPE_2_2, tmp_path / "g.jpg")
    assert not (tmp_path / "g.jpg").exists()


def test_squeezed_ascii_marks_odd_chunks_in_lower_case() -> None:
    # Rank 0 holds stages 0 and 3 of a V: 3F0 is its second chunk.
    tl = timeline(
        [
            "0F0@0-1 3F0@3-4 3B0@4-6 0B0@8-10",
            "1F0@1-2 2F0@2-3 2B0@6-7 1B0@7-8",
        ]
    )
    rows = text_grid(tl, width=25).splitlines()
    assert rows[2] == "r0| F0....f0b0- ....B0- "
    assert rows[3] == "r1| ..F0f0......b0B0...."
    assert rows[-1].startswith("(squeezed: lower case = odd chunks")
    assert "0F0" in text_grid(tl, width=200) and "(squeezed" not in text_grid(tl, width=200)


@pytest.mark.parametrize("unit", [1e-6, 1.0, 1e9])
def test_ascii_of_measured_times_at_any_scale(unit: float) -> None:
    tl = timeline(["0F0@0-1.2 0B0@4-6.1", "1F0@1.3-2.5 1B0@2.5-3.9"])
    scaled = Timeline(
        "m",
        2,
        tuple(Event(e.rank, e.action, e.start * unit, e.end * unit) for e in tl.events),
    )
    rows = text_grid(scaled).splitlines()
    assert rows[1].split() == ["t|", "0", f"{5 * unit:g}"]
    assert rows[2] == "r0| 0F0 .........0B0--- ."
    assert rows[3] == "r1| ....1F0 1B0- ........"


def test_a_measured_plot_names_its_unit_and_no_bubble_when_ranks_took_turns(
    tmp_path: Path,
) -> None:
    # The trainer draws measured seconds: the picture said "makespan 0.0291" and "time";
    # in the debug mode it gave a bubble the run summary rightly refuses to give.
    text = plot(GPIPE_2_2, tmp_path / "m.svg", unit="s").read_text()
    assert "<!-- time (s) -->" in text and f"makespan {GPIPE_2_2.makespan:g} s" in text
    assert "bubble: " in text
    text = plot(GPIPE_2_2, tmp_path / "t.svg", unit="s", taking_turns=True).read_text()
    assert "ranks took turns in one process: idle time is not a bubble" in text
    assert "bubble: " not in text
    # One rank in one process (--pp 1) takes no turns.
    one = Timeline("one", 1, tuple(e for e in GPIPE_2_2.events if e.rank == 0))
    assert "bubble: " in plot(one, tmp_path / "o.svg", unit="s", taking_turns=True).read_text()
    # A simulation's units have no name, as before.
    text = plot(GPIPE_2_2, tmp_path / "u.svg").read_text()
    assert "<!-- time -->" in text and "bubble: " in text


def _comm_tracks(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and "comm" in names[(e["pid"], e["tid"])]:
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    return tracks


def test_chrome_trace_puts_timed_messages_on_comm_tracks() -> None:
    # The trace held compute only: with a latency the gaps had no visible cause.
    schedule = build_schedule("1f1b", 2, 2)
    result = simulate(schedule, Costs(latency=1.0))
    sent = transfers(result.timeline, schedule.placement, 1.0)
    trace = chrome_trace(result.timeline, us_per_unit=10.0, messages=[sent])
    tracks = _comm_tracks(trace)
    comm = [e for events in tracks.values() for e in events]
    # F0, F1 forward and two gradients back, each a send on one rank and a recv on the other.
    assert sorted(e["name"] for e in comm) == sorted(
        f"{way} {a}" for a in ("0F0", "0F1", "1B0", "1B1") for way in ("send", "recv")
    )
    # Off the compute tracks (tid = rank), and no two slices overlap on one track.
    assert all(tid >= 2 for _, tid in tracks)
    for events in tracks.values():
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
        assert all(a[1] <= b[0] for a, b in pairwise(spans))
    # The times are the simulator's: each receive ends when its consumer starts.
    start = {str(e.action): e.start * 10.0 for e in result.timeline.events}
    recv = {e["name"]: e for e in comm if e["name"].startswith("recv")}
    assert recv["recv 0F0"]["ts"] + recv["recv 0F0"]["dur"] == start["1F0"] == 20.0
    assert recv["recv 1B0"]["ts"] + recv["recv 1B0"]["dur"] == start["0B0"]
    # An arrow per message, from the send's track to the receive's.
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert sorted(e["ph"] for e in flows) == ["f"] * 4 + ["s"] * 4
    json.dumps(trace)
    # A lowered schedule's messages are named by its own SEND and RECV actions.
    lowered = lower(schedule)
    timed = replay(lowered, Costs(latency=1.0))
    trace = chrome_trace(timed, messages=[transfers(timed, lowered.placement, 1.0)])
    names = {e["name"] for events in _comm_tracks(trace).values() for e in events}
    assert {"0SEND_F0", "1RECV_F0", "1SEND_B1", "0RECV_B1"} <= names
    # Free messages (the default) add nothing.
    free = simulate(schedule)
    assert transfers(free.timeline, schedule.placement, 0.0) == ()
    assert _comm_tracks(chrome_trace(free.timeline)) == {}


def test_chrome_trace_puts_a_timed_allreduce_on_the_comm_track() -> None:
    schedule = build_schedule("chimera", 4, 4)
    result = simulate(schedule, Costs(allreduce=1.0))
    tracks = _comm_tracks(chrome_trace(result.timeline))
    reduces = [e for events in tracks.values() for e in events]
    timed = [e for e in result.timeline.events if e.action.kind is Kind.ALLREDUCE]
    assert len(reduces) == len(timed) > 0
    assert all(e["cat"] == "step" and e["dur"] == 1000.0 for e in reduces)
    # And none is left on a compute track, where it would overlap the compute.
    on_compute = [e for e in chrome_trace(result.timeline)["traceEvents"] if e.get("tid", 0) < 4]
    assert not any("ALLREDUCE" in e["name"] for e in on_compute if e["ph"] == "X")


def test_chrome_trace_shows_dp_all_reduces_gathers_and_reduce_scatters() -> None:
    schedule = build_schedule("1f1b", 2, 2)
    result = simulate(schedule)
    dp = data_parallel_cost(result.timeline, schedule.placement, 100.0, replicas=2, bandwidth=50.0)
    tracks = _comm_tracks(chrome_trace(result.timeline, links=[dp.spans]))
    # One ring all-reduce of 100 bytes over 2 replicas at 50 bytes/unit takes 2 units,
    # after each stage's last B, and it ends when the cost says the rank finishes.
    got = sorted((e["name"], e["ts"], e["dur"]) for events in tracks.values() for e in events)
    assert got == [("all-reduce stage 0", 9000.0, 2000.0), ("all-reduce stage 1", 7000.0, 2000.0)]
    assert dp.finish == (11.0, 9.0)
    sharded = sharded_cost(schedule, Costs(), 100.0, replicas=2, bandwidth=50.0)
    assert sharded.timeline is not None
    tracks = _comm_tracks(chrome_trace(sharded.timeline, links=[sharded.spans]))
    got = sorted((e["name"], e["ts"]) for events in tracks.values() for e in events)
    assert got == [
        ("all-gather stage 0", 0.0),
        ("all-gather stage 1", 0.0),
        ("reduce-scatter stage 0", 10000.0),
        ("reduce-scatter stage 1", 8000.0),
    ]
    # The traced replay is the held one: the first F waits for its gather.
    assert min(e.start for e in sharded.timeline.events) == 1.0


@pytest.fixture(scope="module")
def long_runs() -> list[SimResult]:
    """m = 64 on 4 ranks: far wider than a terminal, so every grid is squeezed."""
    return [simulate(registry.build_schedule(n, 4, 64)) for n in ("1f1b", "zb-v", "gpipe")]


@pytest.mark.parametrize("width", [20, 57, 120])
def test_squeezed_grid_and_its_ruler_stay_within_the_width(
    long_runs: list[SimResult], width: int
) -> None:
    for result in long_runs:
        lines = text_grid(result.timeline, width=width).splitlines()
        # The header and the chunk legend are text; the ruler and the rows are the grid.
        grid = [line for line in lines[1:] if not line.startswith("(squeezed")]
        assert len(grid) == 1 + result.num_ranks
        assert max(len(line) for line in grid) <= width, (result.schedule, width)


def test_unwritable_trace_and_picture_are_one_line_errors(tmp_path: Path) -> None:
    tl = simulate(registry.build_schedule("1f1b", 2, 2)).timeline
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(RenderError, match=r"cannot write .*trace\.json.*: pick a writable"):
        write_chrome_trace(tl, missing / "trace.json")
    with pytest.raises(RenderError, match="Is a directory"):
        write_chrome_trace(tl, tmp_path)
    folder = tmp_path / "picture.png"
    folder.mkdir()
    with pytest.raises(RenderError, match=r"cannot write .*picture\.png"):
        plot(tl, folder)
