"""Pieces of the runtime: message headers, the in-memory transport, timelines, the table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipetrain.runtime import PipelineInputError, build_pipeline
from pipetrain.runtime.errors import StageMismatchError
from pipetrain.runtime.executor import RankExecutor
from pipetrain.runtime.timeline import (
    compare_with_simulation,
    measured_costs,
    merge_timelines,
)
from pipetrain.runtime.transport import InMemoryTransport
from pipetrain.runtime.wire_format import (
    HEADER_LEN,
    PACK_LIMIT,
    MessageKey,
    describe_failure,
    header_values,
    is_packable,
    pack,
    packed_size,
    parse_header,
    specs_of,
    unpack,
)
from pipetrain.schedules import Action, Kind, Placement, Schedule, parse_action
from pipetrain.schedules.execution import Event, Timeline


def test_header_round_trip_gives_dtypes_and_shapes():
    key = MessageKey(3, True, 7)
    tensors = (
        torch.zeros(2, 5, 4),
        torch.zeros(2, 5, dtype=torch.int64),
        torch.zeros((), dtype=torch.bfloat16),
    )
    values = header_values(4, 2, key, tensors)
    assert parse_header(values, 4, 2, key) == [
        (torch.float32, (2, 5, 4)),
        (torch.int64, (2, 5)),
        (torch.bfloat16, ()),
    ]


@pytest.mark.parametrize(
    ("step", "src", "key"),
    [
        (5, 2, MessageKey(3, True, 7)),
        (4, 1, MessageKey(3, True, 7)),
        (4, 2, MessageKey(3, False, 7)),
    ],
)
def test_a_message_that_is_not_the_expected_one_names_both_stages(step, src, key):
    values = header_values(4, 2, MessageKey(3, True, 7), (torch.zeros(1),))
    with pytest.raises(StageMismatchError, match=f"stage 3 expected .* from stage {src}"):
        parse_header(values, step, src, key)


def test_a_wrong_message_is_named_in_the_callers_step_with_the_wire_number_beside():
    values = header_values(4, 2, MessageKey(3, True, 7), (torch.zeros(1),))
    with pytest.raises(StageMismatchError) as info:
        parse_header(values, 5, 2, MessageKey(3, True, 7), "training step 3 (accumulation 2 of 2)")
    assert "from stage 2 in training step 3 (accumulation 2 of 2) (step 5 on the wire)" in str(
        info.value
    )
    assert "= (4, 2, 3, 7, 1)" in str(info.value)


def test_header_limits_are_input_errors():
    key = MessageKey(1, False, 0)
    with pytest.raises(StageMismatchError, match="at most 8"):
        header_values(0, 0, key, tuple(torch.zeros(1) for _ in range(9)))
    with pytest.raises(StageMismatchError, match="up to 6 dims"):
        header_values(0, 0, key, (torch.zeros(1, 1, 1, 1, 1, 1, 1),))


def test_failures_are_described_by_cause():
    assert "was lost" in describe_failure(
        RuntimeError("[pair.cc:553] Connection closed by peer [1.2.3.4]:5"), 9
    )
    assert "within 9 s" in describe_failure(RuntimeError("Timed out waiting 9000ms for recv"), 9)


def test_in_memory_transport_matches_by_name_and_reports_leftovers():
    t = InMemoryTransport()
    t.begin_step(0, ())
    a, b = MessageKey(1, False, 0), MessageKey(1, False, 1)
    t.send(b, 0, (torch.ones(1),))
    assert t.recv(a, 0) is None
    assert torch.equal(t.recv(b, 0)[0], torch.ones(1))
    t.send(a, 0, (torch.ones(1),))
    with pytest.raises(Exception, match="never received"):
        t.end_step()


class _FakeAction:
    stage, microbatch = 0, 0
    kind = "X"


def test_an_action_of_unknown_kind_fails_when_built():
    schedule = Schedule.build("odd", Placement.linear(1), 1, [[_FakeAction()]])
    with pytest.raises(PipelineInputError, match="cannot run"):
        RankExecutor(schedule, 0, {0: object()}, InMemoryTransport(), reducer=None)


def test_measured_costs_and_simulation_of_a_perfect_run():
    # A GPipe run on 2 ranks with F = 1, B = 2 exactly as the replay would place it.
    p = Placement.linear(2)
    events = []
    for k in range(2):
        events.append(Event(0, Action(0, Kind.F, k), k, k + 1))
        events.append(Event(1, Action(1, Kind.F, k), k + 1, k + 2))
    for k in range(2):
        events.append(Event(1, Action(1, Kind.B, k), 3 + 2 * k, 5 + 2 * k))
        events.append(Event(0, Action(0, Kind.B, k), 5 + 2 * k, 7 + 2 * k))
    rows = [[e.action for e in events if e.rank == r] for r in range(2)]
    schedule = Schedule.build("gpipe", p, 2, rows)
    timeline = Timeline("gpipe", 2, tuple(events))
    costs = measured_costs(timeline, schedule)
    assert costs.forward == (1.0, 1.0) and costs.backward == (2.0, 2.0)
    assert costs.backward_input == (1.0, 1.0)  # B split evenly when the run had no I/W
    comparison = compare_with_simulation(timeline, schedule)
    assert comparison.measured_makespan_s == comparison.simulated_makespan_s == 9.0
    assert comparison.ratio == 1.0
    assert comparison.measured_bubble == comparison.simulated_bubble


def _ev(rank, text, start, end):
    return Event(rank, parse_action(text), start, end)


def test_merged_timeline_puts_ranks_that_left_the_barrier_apart_on_one_clock():
    # Rank 1 left the start barrier 1.0 later than rank 0, so its readings (from its own
    # origin) are 1.0 early: its receive of micro-batch 0 "ends" before rank 0 sent it.
    rank0 = (
        _ev(0, "0F0", 0.0, 1.0),
        _ev(0, "0SEND_F0", 1.0, 1.1),
        _ev(0, "0RECV_B0", 1.1, 4.25),
        _ev(0, "0B0", 4.25, 6.25),
    )
    rank1 = (
        _ev(1, "1RECV_F0", 0.0, 0.15),
        _ev(1, "1F0", 0.15, 1.15),
        _ev(1, "1B0", 1.15, 3.15),
        _ev(1, "1SEND_B0", 3.15, 3.2),
    )
    timeline = merge_timelines("1f1b", 2, [rank0, rank1])
    at = {str(e.action): e for e in timeline.events}
    # Moved by the least that makes the receive end after the send started; durations kept.
    assert at["1RECV_F0"].end == pytest.approx(at["0SEND_F0"].start)
    assert at["0F0"].start == 0.0  # rank 0 stays: it needs no move
    assert at["1F0"].start == pytest.approx(at["0F0"].end)  # not before its input existed
    assert at["1B0"].duration == pytest.approx(2.0)
    assert at["0RECV_B0"].end >= at["1SEND_B0"].start
    assert timeline.makespan == pytest.approx(6.25)
    # A causal timeline (one clock, as in the debug mode) is left exactly as it was.
    causal = [rank0, tuple(_ev(1, str(e.action), e.start + 1.0, e.end + 1.0) for e in rank1)]
    assert {e for e in merge_timelines("1f1b", 2, causal).events} == {*causal[0], *causal[1]}


def test_debug_timeline_simulates_and_draws(tmp_path):
    from pipetrain.models import get_model_config, model_spec
    from pipetrain.sim.render import text_grid, write_chrome_trace

    spec = model_spec(get_model_config("llama-tiny"))
    pipe = build_pipeline(spec, schedule="zb-h1", ranks=2, microbatches=4, device="cpu")
    ids = torch.randint(0, 256, (4, 9))
    result = pipe.step(ids[:, :-1], ids[:, 1:])
    comparison = compare_with_simulation(result.timeline, pipe.schedule)
    assert comparison.simulated_makespan_s > 0
    # In the debug mode ranks take turns, so the measured span is at least the simulated one.
    assert comparison.measured_makespan_s >= comparison.simulated_makespan_s * 0.99
    assert text_grid(result.timeline).count("\n") >= 2
    trace = json.loads(
        write_chrome_trace(result.timeline, tmp_path / "t.json", us_per_unit=1e6).read_text()
    )
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert names == {str(a) for row in pipe.schedule.actions for a in row}


def test_the_runtime_imports_neither_the_trainer_nor_the_cli():
    code = (
        "import sys, pipetrain.runtime, pipetrain.runtime.timeline; "
        "bad = sorted(m for m in sys.modules if m.startswith(('pipetrain.train', 'pipetrain.cli'))); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_packed_message_round_trip():
    # Mixed dtypes and odd sizes: every part lands on a 64-byte boundary, so the unpacked
    # tensors are aligned views that equal what was packed, bit for bit.
    key = MessageKey(3, True, 5)
    tensors = (
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int64),
        torch.tensor(2.5, dtype=torch.bfloat16),
        torch.zeros(0, 4),
        torch.tensor([True, False, True]),
    )
    values = header_values(9, 4, key, tensors)
    buf = pack(values, tensors)
    specs = specs_of(tensors)
    assert buf.dtype == torch.uint8 and buf.numel() == packed_size(specs)
    assert packed_size(specs) % 64 == 0 and packed_size(specs) >= HEADER_LEN * 8 + 60 + 56
    got_values, got = unpack(buf, specs)
    assert got_values == values
    assert parse_header(got_values, 9, 4, key) == specs
    for want, t in zip(tensors, got, strict=True):
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
        assert (t.data_ptr() - buf.data_ptr()) % 64 == 0
    # A received tensor becomes an input leaf that autograd can use.
    leaf = got[0].detach().requires_grad_(True)
    (leaf * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full((3, 5), 2.0))


def test_only_small_messages_are_packed():
    small = [(torch.float32, (2, 128, 128))]  # 128 KiB: one micro-batch of llama-default, m = 16
    large = [(torch.float32, (8, 128, 128))]  # 512 KiB and the header: m = 4
    assert is_packable(small) and not is_packable(large)
    assert packed_size(large) > PACK_LIMIT >= packed_size(small)
