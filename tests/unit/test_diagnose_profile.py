"""--profile's pieces without processes: the step range (run.profile), the ranges' names,
the ranged handlers under torch.profiler, and the merge of per-rank traces onto one clock."""

from __future__ import annotations

from typing import Any

import pytest
from torch.profiler import ProfilerActivity, profile

from pipetrain.config import ConfigError
from pipetrain.config.schema import RunConfig
from pipetrain.config.steps import parse_steps
from pipetrain.diagnose.trace_merge import RankTrace, merge_traces, range_totals
from pipetrain.runtime.ranges import parse_range_name, range_name, ranged_handlers
from pipetrain.schedules import Action, Kind


def test_profile_steps_parse() -> None:
    assert RunConfig(steps=10, profile="5-6").profile_steps == range(5, 7)
    assert RunConfig(steps=10, profile="3").profile_steps == range(3, 4)
    assert RunConfig(steps=10).profile_steps == range(0)
    assert parse_steps("run.profile", "1-10", 10) == range(1, 11)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("x", "not a step or a range"),
        ("5-", "not a step or a range"),
        ("2,3", "not a step or a range"),
        ("0-2", "names no step"),
        ("6-5", "names no step"),
        ("9-11", "goes past the run's last step (10)"),
    ],
)
def test_bad_profile_steps_are_one_line_naming_the_field(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig(steps=10, profile=text)
    message = str(info.value)
    assert message.startswith(f"run.profile {text!r}") and says in message
    assert "\n" not in message


def test_profile_details_need_profile() -> None:
    with pytest.raises(ConfigError, match="need --profile"):
        RunConfig(profile_memory=True)
    assert RunConfig(steps=4, profile="2", profile_shapes=True, profile_memory=True).profile


@pytest.mark.parametrize("kind", list(Kind))
def test_range_names_round_trip(kind: Kind) -> None:
    action = Action(2, kind, None if kind is Kind.ALLREDUCE else 7)
    name = range_name(action)
    assert parse_range_name(name) == action
    if kind is Kind.F:
        assert name == "F stage 2 mb 7"


@pytest.mark.parametrize("name", ["aten::mm", "training step 3", "F stage x mb 1", "Q stage 1"])
def test_other_names_are_not_actions(name: str) -> None:
    assert parse_range_name(name) is None


def test_ranged_handlers_name_each_action_and_keep_results() -> None:
    actions = [Action(1, Kind.F, 3), Action(1, Kind.SEND_F, 3)]
    ran: list[Action] = []

    def handler(action: Action) -> bool:
        ran.append(action)
        return action.kind is Kind.F

    wrapped = ranged_handlers(actions, [handler, handler], nvtx=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        results = [h(a) for h, a in zip(wrapped, actions, strict=True)]
    assert results == [True, False] and ran == actions
    keys = {avg.key for avg in prof.key_averages()}
    assert {"F stage 1 mb 3", "SEND_F stage 1 mb 3"} <= keys


def _x(name: str, ts: float, dur: float, pid: int = 7, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def _meta(pid: int) -> dict[str, Any]:
    return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}}


def test_merge_aligns_clocks_by_messages_and_moves_every_event() -> None:
    # Rank 1's clock is 1000 us behind: its receive of 0SEND_F0 seems to end before the send.
    rank0 = [_meta(7), _x("F stage 0 mb 0", 0, 50), _x("SEND_F stage 0 mb 0", 60, 5)]
    rank1 = [
        _meta(9),
        _x("RECV_F stage 1 mb 0", -990, 20, pid=9),
        _x("F stage 1 mb 0", -960, 40, pid=9),
        _x("aten::mm", -950, 10, pid=9),
        _x("kernel", -945, 3, pid=0, tid=7),  # a GPU stream of rank 1's process
    ]
    merged = merge_traces(
        [RankTrace(0, rank0, 0), RankTrace(1, rank1, 1)], rank_of_stage=lambda s: s
    )
    events = {(e["pid"], e["name"]): e for e in merged["traceEvents"] if e["ph"] == "X"}
    send, recv = events[(0, "SEND_F stage 0 mb 0")], events[(1, "RECV_F stage 1 mb 0")]
    assert recv["ts"] + recv["dur"] == pytest.approx(send["ts"])  # the least shift
    assert events[(0, "F stage 0 mb 0")]["ts"] == 0  # the merged trace starts at 0
    shift = recv["ts"] - (-990)
    # Recorded before the trace is moved to start at 0: rank 1's receive ended 1030 us early.
    assert merged["otherData"]["clock_shift_us"] == {"rank 0": 0.0, "rank 1": 1030.0}
    assert events[(1, "aten::mm")]["ts"] == pytest.approx(-950 + shift)
    kernel = next(e for e in merged["traceEvents"] if e["name"] == "kernel")
    assert kernel["ts"] == pytest.approx(-945 + shift) and kernel["pid"] not in (0, 1)
    names = {
        e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"
    }
    assert (
        names[0] == "rank 0" and names[1] == "rank 1" and names[kernel["pid"]].startswith("rank 1")
    )
    totals = range_totals(merged)
    assert totals[1] == {"compute": 40.0, "send": 0.0, "recv": 20.0}


def test_merge_of_one_process_puts_events_on_their_actions_rank() -> None:
    # The debug mode: stages 0 and 1 (ranks 0 and 1) in one trace, on one clock.
    events = [
        _meta(7),
        _x("F stage 0 mb 0", 100, 50),
        _x("aten::mm", 110, 10),
        _x("F stage 1 mb 0", 200, 50),
        _x("aten::add", 210, 10),
        _x("Optimizer.step", 300, 10),
    ]
    merged = merge_traces([RankTrace(0, events, None)], rank_of_stage=lambda s: s)
    track = {e["name"]: (e["pid"], e["ts"]) for e in merged["traceEvents"] if e["ph"] == "X"}
    assert track["F stage 0 mb 0"] == (0, 0) and track["aten::mm"] == (0, 10)
    assert track["F stage 1 mb 0"] == (1, 100) and track["aten::add"] == (1, 110)
    assert track["Optimizer.step"][0] == 0  # outside any action: the first track


def test_merge_tells_apart_the_passes_of_one_message() -> None:
    # Two profiled steps: each receive pairs with the send of its own step.
    rank0 = [_x("SEND_F stage 0 mb 0", 0, 5), _x("SEND_F stage 0 mb 0", 1000, 5)]
    rank1 = [
        _x("RECV_F stage 1 mb 0", 10, 5, pid=9),
        _x("RECV_F stage 1 mb 0", 500, 5, pid=9),  # would end before step 2's send at 1000
    ]
    merged = merge_traces([RankTrace(0, rank0, 0), RankTrace(1, rank1, 1)], lambda s: s)
    timed = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    starts = sorted(e["ts"] for e in timed if e["pid"] == 0)
    ends = sorted(e["ts"] + e["dur"] for e in timed if e["pid"] == 1)
    assert all(s <= e for s, e in zip(starts, ends, strict=True))
    assert ends[1] == pytest.approx(starts[1])  # the least shift: step 2's pair binds
