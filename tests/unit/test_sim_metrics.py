"""Metrics on hand-built timelines: the numbers are worked out by hand in the comments."""

from __future__ import annotations

import pytest

from pipetrain.schedules.actions import parse_action
from pipetrain.schedules.execution import Event, Timeline
from pipetrain.sim.metrics import (
    bubble,
    busy_time,
    live_activations,
    peak_activation_bytes,
    peak_activations,
    peak_with_gradients,
    rank_times,
    stage_weight_versions,
    weight_versions,
)


def timeline(rows: list[str], name: str = "t") -> Timeline:
    """One string per rank of ``ACTION@START-END`` items, e.g. ``"0F0@0-1 0B0@3-5"``."""
    events = []
    for rank, row in enumerate(rows):
        for item in row.split():
            text, times = item.split("@")
            start, end = times.split("-")
            events.append(Event(rank, parse_action(text), float(start), float(end)))
    return Timeline(name, len(rows), tuple(events))


# GPipe, p=2, m=2, F=1, B=2: all forwards, then all backwards.
GPIPE_2_2 = timeline(
    [
        "0F0@0-1 0F1@1-2 0B0@5-7 0B1@7-9",
        "1F0@1-2 1F1@2-3 1B0@3-5 1B1@5-7",
    ]
)
# 1F1B, p=2, m=2: rank 0 warms up with one forward, rank 1 alternates.
ONE_F_ONE_B_2_2 = timeline(
    [
        "0F0@0-1 0F1@1-2 0B0@4-6 0B1@7-9",
        "1F0@1-2 1B0@2-4 1F1@4-5 1B1@5-7",
    ]
)


def test_gpipe_times_and_bubbles() -> None:
    t = rank_times(GPIPE_2_2)
    assert GPIPE_2_2.makespan == 9
    assert t.busy == (6, 6)
    assert t.idle == (3, 3)  # (p-1)(F+B)
    assert t.span == (9, 6)
    assert t.span_idle == (3, 0)
    b = bubble(GPIPE_2_2)
    assert b.idle_fraction == pytest.approx(1 / 3)  # (p-1)/(m+p-1)
    assert b.over_ideal == pytest.approx(1 / 2)  # (p-1)/m
    assert b.per_rank_span_time == 3
    assert b.per_rank_span_fraction == pytest.approx(3 / 9)
    assert b.idle_time == 3


def test_peak_activations_gpipe_and_1f1b() -> None:
    assert peak_activations(GPIPE_2_2) == (2, 2)  # m on every rank
    assert peak_activations(ONE_F_ONE_B_2_2) == (2, 1)  # min(p-r, m)


def test_activations_freed_at_a_backward_end_are_reused_by_a_forward_starting_then() -> None:
    # 1B0 ends at 4 exactly when 1F1 starts: never two live on rank 1.
    curve = live_activations(ONE_F_ONE_B_2_2)[1]
    assert curve == ((1, 1), (4, 0), (4, 1), (7, 0))


def test_split_backward_keeps_activations_until_w() -> None:
    # I frees nothing: micro-batch 0 stays live until its W ends at 4.
    tl = timeline(["0F0@0-1 0I0@1-2 0F1@2-3 0W0@3-4 0I1@4-5 0W1@5-6"])
    assert peak_activations(tl) == (2,)
    assert live_activations(tl)[0][-1] == (6, 0)


def test_split_backward_holds_its_output_gradients_from_i_to_w() -> None:
    # Activations 10 a micro-batch; a split backward holds 4 more from its I's start to its
    # W's end. At 2-3 micro-batch 0 is in its I-W gap (10 + 4) while 1 is live (10): 24;
    # without the deferred term 20. A whole B holds nothing extra.
    tl = timeline(["0F0@0-1 0I0@1-2 0F1@2-3 0W0@3-4 0I1@4-5 0W1@5-6"])
    assert peak_activation_bytes(tl, [10.0]) == (20.0,)
    assert peak_activation_bytes(tl, [10.0], [4.0]) == (24.0,)
    assert live_activations(tl, [10.0], [4.0])[0][-1] == (6, 0)
    whole = timeline(["0F0@0-1 0F1@1-2 0B0@2-4 0B1@4-6"])
    assert peak_activation_bytes(whole, [10.0], [4.0]) == (20.0,)


def test_split_backward_lets_go_at_i_what_no_linear_takes() -> None:
    # Activations 10 a micro-batch, 6 of them no linear's input: the end of I lets them go,
    # W keeps 4 (and the 4 pending output gradients). At 2-3 micro-batch 0 holds 4 + 4,
    # micro-batch 1 its 10: 18 where 24 would be counted without the early release.
    tl = timeline(["0F0@0-1 0I0@1-2 0F1@2-3 0W0@3-4 0I1@4-5 0W1@5-6"])
    assert peak_activation_bytes(tl, [10.0], [4.0], [6.0]) == (18.0,)
    curve = live_activations(tl, [10.0], [4.0], [6.0])[0]
    # At 2, I0 ends (its linears' inputs and output gradients stay: 8), then F1 starts.
    assert [level for time, level in curve if time == 2] == [8.0, 18.0]
    assert curve[-1] == (6, 0)
    # A whole B frees everything at its end, as before.
    whole = timeline(["0F0@0-1 0F1@1-2 0B0@2-4 0B1@4-6"])
    assert peak_activation_bytes(whole, [10.0], [4.0], [6.0]) == (20.0,)


def test_within_i_only_the_gradients_beyond_what_it_frees_add_up() -> None:
    # Two micro-batches live (10 each) when I0 starts. The I queues 4 of output gradients
    # as it frees 6 of saved tensors, layer by layer: within it the level stays at 20 (not
    # 24, as if every gradient were queued before anything was freed); from its end micro-
    # batch 0 holds 4 + 4 beside micro-batch 1's 10.
    tl = timeline(["0F0@0-1 0F1@1-2 0I0@2-3 0W0@3-4 0I1@4-5 0W1@5-6"])
    curve = live_activations(tl, [10.0], [4.0], [6.0])[0]
    assert max(level for time, level in curve if time < 3) == 20.0
    assert [level for time, level in curve if time == 3] == [18.0]
    assert peak_activation_bytes(tl, [10.0], [4.0], [6.0]) == (20.0,)
    # Gradients larger than what the I frees (9 against 6): the 3 beyond it are held from
    # the I's start, the rest from its end.
    assert peak_activation_bytes(tl, [10.0], [9.0], [6.0]) == (23.0,)
    curve = live_activations(tl, [10.0], [9.0], [6.0])[0]
    assert [level for time, level in curve if time == 2] == [23.0]
    assert curve[-1] == (6, 0)


def test_gradients_sent_back_are_held_until_the_step_ends() -> None:
    # 1F1B's last rank of two, four micro-batches of 1: each B (or I) sends its input
    # gradient (0.5) to stage 0 on the other rank, and the transport keeps it to the end
    # of the step. At the last F three are held beside one micro-batch's activations.
    tl = timeline(["1F0@0-1 1B0@1-2 1F1@2-3 1B1@3-4 1F2@4-5 1I2@5-6 1W2@6-7 1F3@7-8 1B3@8-9"])
    sent = [0.0, 0.5]
    assert peak_activation_bytes(tl, [0.0, 1.0]) == (1.0,)
    assert peak_activation_bytes(tl, [0.0, 1.0], sent=sent) == (2.5,)
    curve = live_activations(tl, [0.0, 1.0], sent=sent)[0]
    assert curve[-1] == (9.0, 0.0)  # all let go at the end
    # A stage whose previous stage is on this rank sends nothing.
    assert peak_activation_bytes(tl, [0.0, 1.0], sent=[0.0, 0.0]) == (1.0,)


def test_gradients_count_from_a_stage_s_first_backward_and_buckets_from_its_last() -> None:
    # GPipe's rank 0 peaks at the end of its forwards (2), before any .grad exists: the
    # first B's end lets go of a micro-batch and has made the stage's gradients (1 + 5),
    # the last B's end the flat copies the dp all-reduce sums (0 + 5 + 5).
    sizes = [1.0, 1.0]
    assert peak_with_gradients(GPIPE_2_2, [5.0, 3.0], [0.0, 0.0], sizes) == (6.0, 4.0)
    assert peak_with_gradients(GPIPE_2_2, [5.0, 3.0], [5.0, 3.0], sizes) == (10.0, 6.0)
    # Small gradients leave the activations' peak as it was.
    assert peak_with_gradients(GPIPE_2_2, [0.5, 0.5], [0.5, 0.5], sizes) == (2.0, 2.0)
    # 1F1B's last rank runs a forward after its first B: its steady state holds one
    # micro-batch beside the gradients, all of both, as a count would charge them.
    assert peak_with_gradients(ONE_F_ONE_B_2_2, [5.0, 3.0], [0.0, 0.0], sizes)[1] == 4.0
    # A split backward makes its weight gradients in W, which lets go of the micro-batch.
    split = timeline(["0F0@0-1 0I0@1-2 0W0@2-3"])
    assert peak_with_gradients(split, [5.0], [0.0], [1.0]) == (5.0,)
    assert peak_with_gradients(split, [0.5], [0.0], [1.0]) == (1.0,)


def test_activation_bytes_weigh_each_stage() -> None:
    # Rank 0 holds stages 0 and 3 (V placement); stage 3 activations are 10x larger.
    tl = timeline(
        [
            "0F0@0-1 3F0@3-4 3B0@4-6 0B0@8-10",
            "1F0@1-2 2F0@2-3 2B0@6-7 1B0@7-8",
        ]
    )
    sizes = [1.0, 2.0, 4.0, 10.0]
    assert peak_activations(tl) == (2, 2)
    assert peak_activation_bytes(tl, sizes) == (11.0, 6.0)


def test_sends_and_receives_are_not_work() -> None:
    tl = timeline(["0F0@0-1 0SEND_F0@1-1.5", "1RECV_F0@0-1.5 1F0@1.5-2.5"])
    assert rank_times(tl).busy == (1.0, 1.0)
    assert rank_times(tl).span == (1.0, 1.0)


def test_overlapping_work_counts_once() -> None:
    tl = timeline(["0F0@0-2 0F1@1-3 0F2@5-6"])
    assert busy_time(tl.events) == 4.0
    assert rank_times(tl).span_idle == (2.0,)


def test_synchronous_schedules_keep_one_weight_version() -> None:
    assert weight_versions(GPIPE_2_2) == (1, 1)
    assert weight_versions(ONE_F_ONE_B_2_2) == (1, 1)


# PipeDream, p=2: a STEP after every backward. Rank 0 has two micro-batches in flight, so
# the forward of micro-batch 2 runs on version 1 while micro-batch 1 still needs version 0.
PIPEDREAM_2 = timeline(
    [
        "0F0@0-1 0F1@1-2 0B0@4-6 0STEP0@6-6 0F2@6-7 0B1@7-9 0STEP1@9-9 0F3@9-10 "
        "0B2@10-12 0STEP2@12-12 0B3@13-15 0STEP3@15-15",
        "1F0@1-2 1B0@2-4 1STEP0@4-4 1F1@4-5 1B1@5-7 1STEP1@7-7 1F2@7-8 1B2@8-10 "
        "1STEP2@10-10 1F3@10-11 1B3@11-13 1STEP3@13-13",
    ]
)


def test_pipedream_keeps_p_minus_r_versions() -> None:
    assert weight_versions(PIPEDREAM_2) == (2, 1)
    assert stage_weight_versions(PIPEDREAM_2) == {0: 2, 1: 1}


def test_a_version_dies_when_its_last_backward_ends() -> None:
    # Two steps while micro-batch 0 is in flight: versions 0, 1 (unused, dies at once
    # when version 2 arrives) and 2: only 0 and 2 are alive together.
    tl = timeline(["0F0@0-1 0STEP1@1-1 0STEP2@2-2 0F1@2-3 0B0@3-5 0B1@5-7"])
    assert weight_versions(tl) == (2,)


def test_empty_rank_and_empty_timeline() -> None:
    tl = timeline(["0F0@0-1 0B0@1-3", ""])
    t = rank_times(tl)
    assert t.busy == (3.0, 0.0)
    assert t.idle == (0.0, 3.0)
    assert weight_versions(tl) == (1, 0)
    empty = Timeline("empty", 2, ())
    b = bubble(empty)
    assert (b.idle_fraction, b.over_ideal, b.per_rank_span_time) == (0.0, 0.0, 0.0)
    assert peak_activations(empty) == (0, 0)
