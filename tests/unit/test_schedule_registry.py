"""The registry: every name builds, constraints fail up front with the fix, flags are true;
every refusal of its sizes is one line naming a flag."""

from __future__ import annotations

import re

import pytest

from pipetrain.schedules import Kind, ScheduleError, registry
from pipetrain.schedules.execution import Costs, replay
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import (
    SCHEDULE_NAMES,
    ScheduleSpec,
    build_schedule,
    fitting,
    get_spec,
)
from pipetrain.schedules.validate import validate


def test_names() -> None:
    assert SCHEDULE_NAMES == (
        "naive",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "zb-v",
        "dualpipe-v",
        "v-half",
        "v-min",
        "chimera",
        "pipedream",
        "pipedream-2bw",
    )


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_builds_and_validates_where_it_fits(name: str) -> None:
    spec = get_spec(name)
    for p, m in ((2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)):
        if spec.check(p, m) is not None:
            assert name not in fitting(p, m)
            continue
        assert name in fitting(p, m)
        schedule = build_schedule(name, p, m)
        validate(schedule)
        validate(lower(schedule))
        assert schedule.placement.kind == spec.placement
        assert schedule.placement.stages_per_rank == spec.chunks(None)
        assert schedule.asynchronous == spec.asynchronous
        assert schedule.splits_backward == spec.splits_backward
        expected_m = 1 if spec.whole_batch else (2 * m if spec.asynchronous else m)
        assert schedule.microbatches == expected_m


def test_everything_fits_a_generous_case() -> None:
    assert fitting(4, 16) == list(SCHEDULE_NAMES)


def test_only_naive_is_whole_batch() -> None:
    assert [n for n in SCHEDULE_NAMES if get_spec(n).whole_batch] == ["naive"]


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ScheduleError) as info:
        build_schedule("1F1B", 4, 8)
    assert str(info.value) == "unknown schedule '1F1B': use one of " + ", ".join(SCHEDULE_NAMES)


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        (
            "1f1b",
            4,
            2,
            None,
            "1f1b needs --microbatches >= --pp (got m=2, p=4): raise --microbatches to 4 or "
            "more, or use gpipe",
        ),
        ("chimera", 3, 6, None, "chimera needs an even --pp (got p=3): use 4 or 2"),
        ("interleaved-1f1b", 4, 8, 0, "interleaved-1f1b needs --chunks >= 1 (got 0)"),
        ("pipedream-2bw", 4, 2, None, "pipedream-2bw needs --microbatches >= --pp (got m=2"),
        ("dualpipe-v", 4, 4, None, "dualpipe-v needs --microbatches >= 2 x --pp"),
    ],
)
def test_constraints_are_checked_up_front(
    name: str, p: int, m: int, v: int | None, message: str
) -> None:
    assert (get_spec(name).check(p, m, v) or "").startswith(message)
    with pytest.raises(ScheduleError) as info:
        build_schedule(name, p, m, v)
    assert str(info.value).startswith(message)
    assert name not in fitting(p, m, v)


def test_chunks_only_change_the_schedules_that_take_them() -> None:
    assert get_spec("interleaved-1f1b").uses_chunks and get_spec("looped-bfs").uses_chunks
    schedule = build_schedule("interleaved-1f1b", 2, 4, chunks=3)
    assert schedule.placement.stages_per_rank == 3
    assert dict(schedule.params)["v"] == 3
    assert build_schedule("looped-bfs", 2, 4).placement.stages_per_rank == 2  # default v
    # The rest ignore --chunks, so one --chunks can apply to a whole comparison.
    assert build_schedule("gpipe", 2, 4, chunks=3) == build_schedule("gpipe", 2, 4)
    assert build_schedule("zb-v", 2, 4, chunks=3).placement.stages_per_rank == 2
    assert "gpipe" in fitting(2, 4, chunks=3)


def test_spec_is_frozen() -> None:
    spec = get_spec("gpipe")
    assert isinstance(spec, ScheduleSpec)
    with pytest.raises(AttributeError):
        spec.name = "other"  # type: ignore[misc]


def test_asynchronous_schedules_step_inside_the_stream() -> None:
    for name in ("pipedream", "pipedream-2bw"):
        schedule = build_schedule(name, 4, 4)
        assert any(a.kind is Kind.STEP for _, _, a in schedule.enumerate_actions())


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_lowering_keeps_every_schedule_timing(name: str) -> None:
    # Sends and receives only make the implicit transfers explicit: same times, any costs.
    schedule = build_schedule(name, 4, 8)
    n = schedule.placement.num_model_stages
    uneven = tuple(1.0 + 0.25 * (j % 3) for j in range(n))
    costs = Costs(latency=0.3, allreduce=0.5, step=0.25, forward=uneven, backward_weight=uneven)
    plain = {(e.rank, e.action): (e.start, e.end) for e in replay(schedule, costs).events}
    lowered = replay(lower(schedule), costs).events
    assert {(e.rank, e.action): (e.start, e.end) for e in lowered if not e.action.is_comm} == plain


def _sizes(p: int) -> list[int]:
    return sorted({1, max(p - 1, 1), p, 2 * p + 1, 32})


def test_every_refusal_of_the_registry_is_one_line_naming_a_flag() -> None:
    refused = 0
    for name in registry.SCHEDULE_NAMES:
        spec = registry.get_spec(name)
        for p in (1, 2, 3, 4, 8):
            for m in _sizes(p):
                for v in (None, 1, 3) if spec.uses_chunks else (None,):
                    reason = spec.check(p, m, v)
                    if reason is None:
                        continue
                    refused += 1
                    assert "\n" not in reason, (name, p, m, v)
                    assert "--" in reason, (name, p, m, v, reason)
                    # "use 2 or 2" offers one fix twice (Chimera at p = 1 did).
                    assert not re.search(r"\buse (\d+) or \1\b", reason), reason
    assert refused > 50  # the sweep reaches the constraints, not only the easy sizes
