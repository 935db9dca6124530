"""Plans: placement follows the schedule, live activations match the simulator, memory advice."""

from __future__ import annotations

import pytest

from pipetrain.errors import InputError
from pipetrain.models.config import get_model_config
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.planner import Overheads, make_plan
from pipetrain.partition.stages import split_layers, stage_live_peaks
from pipetrain.schedules.placement import Placement
from pipetrain.schedules.registry import build_schedule, get_spec
from pipetrain.sim.simulator import simulate

COSTS = estimate_costs(get_model_config("llama-default"), 128)


def _plan(schedule: str = "1f1b", pp: int = 3, chunks: int | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    spec = get_spec(schedule)
    options = {"batch_size": 32, "microbatches": 8, **kwargs}
    return make_plan(COSTS, schedule_for=lambda m: spec.build(pp, m, chunks), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "chimera"]
)
def test_live_activations_agree_with_the_simulator(name: str) -> None:
    schedule = build_schedule(name, 4, 8)
    per_stage = stage_live_peaks(schedule)
    per_rank = simulate(schedule).peak_activations
    placement = schedule.placement
    for rank in range(4):
        held = [per_stage[s] for s in placement.stages_of(rank)]
        if len(held) == 1:
            assert per_rank[rank] == held[0]
        else:  # a rank with several stages peaks at most at the sum of their peaks
            assert max(held) <= per_rank[rank] <= sum(held)


def test_one_f_one_b_holds_p_minus_rank_micro_batches() -> None:
    assert stage_live_peaks(build_schedule("1f1b", 4, 8)) == (4, 3, 2, 1)
    assert stage_live_peaks(build_schedule("gpipe", 4, 8)) == (8, 8, 8, 8)


def test_main_job_uniform_plan() -> None:
    plan = _plan()
    assert [s.blocks for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert [(s.embedding, s.head) for s in plan.stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert [s.ranks for s in plan.stages] == [(0,), (1,), (2,)]
    assert (plan.stages[0].first, plan.stages[2].last) == ("embed", "head")
    assert [s.live for s in plan.stages] == [3, 2, 1]
    assert plan.imbalance == pytest.approx(
        max(plan.partition.time) / (sum(plan.partition.time) / 3)
    )
    assert plan.step_time > max(plan.rank_time)  # the bubble is not free
    out = plan.to_json()
    assert {"stages", "imbalance"} <= set(out)
    assert {"rank", "blocks", "embedding", "head", "params", "time", "activation_bytes"} <= set(
        out["stages"][0]
    )


def test_placement_follows_the_schedule() -> None:
    looped = _plan("interleaved-1f1b", chunks=2, microbatches=6, batch_size=36)
    assert [s.ranks[0] for s in looped.stages] == [0, 1, 2, 0, 1, 2]
    v_shape = _plan("zb-v")
    assert [s.ranks[0] for s in v_shape.stages] == [0, 1, 2, 2, 1, 0]
    chimera = _plan("chimera", pp=4, microbatches=8)
    assert [s.ranks for s in chimera.stages] == [(0, 3), (1, 2), (2, 1), (3, 0)]


def test_memory_advice_is_the_largest_micro_batch_that_fits() -> None:
    unlimited = _plan()
    limit = max(unlimited.rank_bytes) * 1.5
    plan = _plan(memory_limit=limit)
    mb = plan.max_microbatch_size
    assert mb is not None and mb >= plan.microbatch_size

    def needs(size: int) -> float:
        scale = size / plan.microbatch_size
        return max(
            s + a * scale
            for s, a in zip(plan.rank_static_bytes, plan.rank_peak_activation_bytes, strict=True)
        )

    assert needs(mb) <= limit < needs(mb + 1)
    assert all(o.fits == (o.peak_bytes <= limit) for o in plan.options)
    best = plan.recommended
    assert best is not None
    assert best.step_time == min(o.step_time for o in plan.options if o.fits)


def test_options_skip_counts_the_schedule_cannot_run() -> None:
    plan = _plan(pp=3)
    assert [o.microbatches for o in plan.options] == [4, 8, 16, 32]  # 1F1B needs m >= p


def test_fixed_overheads_make_tiny_micro_batches_slow() -> None:
    plan = _plan(overheads=Overheads(per_layer=5e-3, latency=1e-3))
    assert plan.recommended is not None and plan.recommended.microbatches < 32


def test_params_balance_with_a_binding_limit_is_honoured() -> None:
    plan = _plan(method="params", memory_limit=max(_plan().rank_bytes))
    assert max(plan.rank_bytes) <= max(_plan().rank_bytes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_limit": 1e6}, "memory limit"),
        ({"method": "params", "memory_limit": 1e6}, "memory limit"),
        ({"batch_size": 30}, "not a whole number of --microbatches"),
        ({"split": (4, 4, 5)}, "adds up to 13"),
    ],
)
def test_plans_that_cannot_work_say_what_to_change(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        _plan(**kwargs)


def test_split_layers_for_a_placement() -> None:
    config = get_model_config("llama-default")
    assert split_layers(config, Placement.linear(3)) == (
        tuple(range(0, 5)),
        tuple(range(5, 9)),
        tuple(range(9, 14)),
    )
    assert split_layers(config, Placement.linear(3), split="5,4,3")[0] == tuple(range(0, 6))
    v_shape = split_layers(config, Placement.v_shape(3), method="params")
    assert len(v_shape) == 6 and [i for s in v_shape for i in s] == list(range(14))
    assert len(split_layers(config, Placement.bidirectional(4))) == 4


def test_stashed_weight_versions_count_in_memory() -> None:
    sync = _plan("1f1b", pp=4)
    stash = _plan("pipedream", pp=4)
    assert stash.partition.stages == sync.partition.stages
    for rank in range(4):
        versions = 4 - rank  # PipeDream: rank r keeps p - r versions
        extra = (versions - 1) * stash.partition.param_bytes[rank]
        assert stash.rank_static_bytes[rank] == pytest.approx(sync.rank_static_bytes[rank] + extra)
