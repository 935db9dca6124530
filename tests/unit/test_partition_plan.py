"""Plans: placement follows the schedule, live activations match the simulator, memory advice.

The balancer against what it claims, on the built-in models: under a memory limit it
counts PipeDream's stashed weight versions, naive's whole batch, several stages per rank
and a tied embedding held once as the plan's table does, and a limit that the uniform
split meets gives a split at least as even.
"""

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

MiB = 2**20
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


@pytest.mark.parametrize(
    ("schedule", "limit_mib"), [("pipedream", 60), ("pipedream", 80), ("pipedream-2bw", 58)]
)
def test_params_balance_counts_stashed_weight_versions_under_a_limit(
    schedule: str, limit_mib: int
) -> None:
    # The balancer charged one weight version per stage, chose a split that fit that count,
    # and the plan then refused it for the versions PipeDream stashes ("use --balance
    # params"), although a split that fits exists (the one chosen at 70 MiB).
    spec = get_spec(schedule)
    plan = make_plan(
        COSTS,
        schedule_for=lambda m: spec.build(4, m, None),
        batch_size=32,
        microbatches=8,
        method="params",
        memory_limit=limit_mib * MiB,
    )
    assert max(plan.rank_bytes) <= limit_mib * MiB


def test_naive_stages_hold_the_whole_batch_in_the_stage_table_and_the_balancer() -> None:
    # Naive model parallel runs the whole batch in one action: the stage table said one live
    # micro-batch (a quarter of the rank table's peak), and the memory-limited balancer
    # counted that quarter, so its split came back refused as over the limit.
    spec = get_spec("naive")

    def plan(**kwargs: object):  # type: ignore[no-untyped-def]
        return make_plan(
            COSTS,
            schedule_for=lambda m: spec.build(3, m, None),
            batch_size=32,
            microbatches=4,
            whole_batch=spec.whole_batch,
            **kwargs,  # type: ignore[arg-type]
        )

    free = plan()
    assert [s.live for s in free.stages] == [4, 4, 4]
    assert [s.peak_activation_bytes for s in free.stages] == pytest.approx(
        list(free.rank_peak_activation_bytes)
    )
    limit = max(free.rank_bytes)
    balanced = plan(method="params", memory_limit=limit)
    assert max(balanced.rank_bytes) <= limit
    # More micro-batches do not shrink what naive holds (the advice was to add them).
    for method in ("uniform", "params"):
        with pytest.raises(InputError, match="a smaller --batch-size"):
            plan(method=method, memory_limit=limit / 2)


def _stage_plan(schedule: str, pp: int, chunks: int | None, **kwargs: object):  # type: ignore[no-untyped-def]
    spec = get_spec(schedule)
    return make_plan(
        COSTS,
        schedule_for=lambda m: spec.build(pp, m, chunks),
        batch_size=32,
        microbatches=8,
        whole_batch=spec.whole_batch,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks"),
    [("zb-v", 2, None), ("interleaved-1f1b", 2, 2), ("dualpipe-v", 2, None), ("chimera", 4, None)],
)
def test_a_limit_that_uniform_meets_gives_a_split_at_least_as_even(
    schedule: str, pp: int, chunks: int | None
) -> None:
    # A rank holding several stages was charged the sum of their peaks, which they never
    # reach together: under the limit that 3 blocks per stage meets, zb-v's params balance
    # put 7 layers on one stage (twice the parameters of the uniform split).
    uniform = _stage_plan(schedule, pp, chunks)
    limit = max(uniform.rank_bytes)
    balanced = _stage_plan(schedule, pp, chunks, method="params", memory_limit=limit)
    assert max(balanced.rank_bytes) <= limit
    assert max(balanced.partition.param_bytes) <= max(uniform.partition.param_bytes)


@pytest.mark.parametrize(
    ("schedule", "pp", "chunks"),
    [("zb-v", 2, None), ("looped-bfs", 2, 3), ("dualpipe-v", 2, None), ("pipedream", 3, None)],
)
def test_the_balancer_charges_a_rank_what_the_plan_reports(
    schedule: str, pp: int, chunks: int | None
) -> None:
    # The free split fits a limit of exactly its own peak, so the limited balancer must find
    # a split as even: it counts a rank's memory as the plan's table does, no more, no less.
    free = _stage_plan(schedule, pp, chunks, method="params")
    limited = _stage_plan(schedule, pp, chunks, method="params", memory_limit=max(free.rank_bytes))
    assert max(limited.partition.param_bytes) == max(free.partition.param_bytes)
    assert max(limited.rank_bytes) <= max(free.rank_bytes)


def test_a_stage_holding_both_ends_of_a_tied_embedding_counts_it_once() -> None:
    # One stage with the embedding and the tied head holds one tensor, but the plan counted
    # the head's copy too: gpt2-124m on one rank showed 163.04M parameters and 2.4 GiB.
    costs = estimate_costs(get_model_config("gpt2-124m"), 128)
    spec = get_spec("1f1b")

    def plan(pp: int, **kwargs: object):  # type: ignore[no-untyped-def]
        return make_plan(
            costs,
            schedule_for=lambda m: spec.build(pp, m, None),
            batch_size=2,
            microbatches=2,
            **kwargs,  # type: ignore[arg-type]
        )

    alone = plan(1)
    assert alone.partition.params == (124_439_808,)  # GPT-2 small, as published
    assert alone.rank_static_bytes[0] == 4 * 4 * 124_439_808  # fp32 weights, grads, AdamW
    assert plan(1, memory_limit=max(alone.rank_bytes), method="params").partition.num_stages == 1
    # Apart, each stage holds its own copy of the 50257 x 768 matrix.
    apart = plan(2, split=(12, 0))
    assert sum(apart.partition.params) == 124_439_808 + 50257 * 768
