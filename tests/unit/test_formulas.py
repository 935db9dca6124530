"""The simulator against the published formulas, with the papers' unit costs.

Every case runs the registry's generator through ``simulate`` and checks the exact number
(``pytest.approx`` only absorbs float rounding). p in {2, 4, 8}, m in {p, 2p, 4p}, wherever
the schedule fits. Notation as in ../shared/reference/schedules.md: F = I = W = 1, B = 2.
"""

from __future__ import annotations

import pytest

from pipetrain.schedules import registry
from pipetrain.schedules.dualpipe import dualpipe_v_lowered
from pipetrain.schedules.execution import Costs
from pipetrain.sim.simulator import SimResult, simulate

F, B, I, W = 1.0, 2.0, 1.0, 1.0  # noqa: E741 (the papers' names)
SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def fitting_cases(
    name: str, chunks: tuple[int | None, ...] = (None,)
) -> list[tuple[int, int, int | None]]:
    spec = registry.get_spec(name)
    return [
        (p, m, v)
        for p, m in SIZES
        for v in chunks
        if spec.check(p, m, 1 if v is None else v) is None
    ]


def run(name: str, p: int, m: int, v: int | None = None, costs: Costs | None = None) -> SimResult:
    spec = registry.get_spec(name)
    schedule = registry.build_schedule(name, p, m, v)
    return simulate(schedule, costs, batch_scale=m if spec.whole_batch else 1)


def ids(case: tuple[int, int, int | None]) -> str:
    p, m, v = case
    return f"p{p}-m{m}" + ("" if v is None else f"-v{v}")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("case", [(p, m, None) for p, m in SIZES], ids=ids)
def test_gpipe_and_1f1b_bubble(name: str, case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run(name, p, m)
    assert r.idle == pytest.approx([(p - 1) * (F + B)] * p)
    assert r.makespan == pytest.approx((m + p - 1) * (F + B))
    assert r.bubble.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert r.bubble.over_ideal == pytest.approx((p - 1) / m)
    # Rank 0 idles the whole ramp inside its span; the last rank never does.
    assert r.bubble.per_rank_span_time == pytest.approx((p - 1) * (F + B))
    assert r.span_idle[-1] == 0
    assert r.weight_versions == (1,) * p


@pytest.mark.parametrize("case", [(p, m, None) for p, m in SIZES], ids=ids)
def test_gpipe_keeps_every_microbatch_on_every_rank(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    assert run("gpipe", p, m).peak_activations == (m,) * p


@pytest.mark.parametrize("case", [(p, m, None) for p, m in SIZES], ids=ids)
def test_1f1b_peak_activations(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    assert run("1f1b", p, m).peak_activations == tuple(min(p - rank, m) for rank in range(p))


@pytest.mark.parametrize("case", fitting_cases("interleaved-1f1b", (2, 4)), ids=ids)
def test_interleaved_bubble_and_rank0_memory(case: tuple[int, int, int]) -> None:
    p, m, v = case
    r = run("interleaved-1f1b", p, m, v)
    assert r.chunks == v
    # Unit costs per chunk: a rank's whole slice costs v(F+B), so the published
    # (p-1)(F+B)/v in whole-slice units is (p-1)(F+B) chunk units.
    assert r.idle == pytest.approx([(p - 1) * (F + B)] * p)
    assert r.bubble.over_ideal == pytest.approx((p - 1) / (v * m))
    # Rank r warms up with 2(p-1-r) + (v-1)p forwards and runs one more before its first
    # backward; when m v is smaller, every chunk of every micro-batch is live at once.
    # Rank 0: 2(p-1) + (v-1)p + 1.
    assert r.peak_activations == tuple(
        min(2 * (p - 1 - rank) + (v - 1) * p + 1, m * v) for rank in range(p)
    )


@pytest.mark.parametrize("case", fitting_cases("looped-bfs", (2, 4)), ids=ids)
def test_looped_bfs(case: tuple[int, int, int]) -> None:
    p, m, v = case
    r = run("looped-bfs", p, m, v)
    assert r.idle == pytest.approx([(p - 1) * (F + B)] * p)
    assert r.bubble.over_ideal == pytest.approx((p - 1) / (v * m))
    assert r.peak_activations == (m * v,) * p


@pytest.mark.parametrize("case", fitting_cases("zb-h1"), ids=ids)
def test_zb_h1(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("zb-h1", p, m)
    assert r.idle == pytest.approx([(p - 1) * (F + I - W)] * p)
    assert r.bubble.per_rank_span_time == pytest.approx((p - 1) * (F + I - W))
    assert r.peak_activations == (p,) * p


@pytest.mark.parametrize("costs", [(1.0, 1.0, 0.5), (2.0, 1.5, 1.0), (1.0, 2.0, 1.0)])
def test_zb_h1_and_h2_with_uneven_split(costs: tuple[float, float, float]) -> None:
    f, i, w = costs
    c = Costs(forward=f, backward=i + w, backward_input=i, backward_weight=w)
    p, m = 4, 16
    assert run("zb-h1", p, m, costs=c).bubble.per_rank_span_time == pytest.approx(
        (p - 1) * (f + i - w)
    )
    assert run("zb-h2", p, m, costs=c).bubble.per_rank_span_time == pytest.approx(
        (p - 1) * (f + i - 2 * w)
    )


@pytest.mark.parametrize("case", fitting_cases("zb-h2"), ids=ids)
def test_zb_h2_has_no_bubble_inside_any_span(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("zb-h2", p, m)
    assert r.span_idle == (0,) * p
    assert r.peak_activations == (2 * p - 1,) * p


@pytest.mark.parametrize("case", fitting_cases("zb-v"), ids=ids)
def test_zb_v(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("zb-v", p, m)
    if m >= 2 * p - 1:
        assert r.span_idle == (0,) * p
        # p stage-equivalents: 2p chunks, each half a rank's layers.
        assert r.peak_activations == (2 * p,) * p
    else:
        assert r.bubble.per_rank_span_time > 0


def test_zb_v_p4_m4_leaves_six_idle_units_in_rank0_span() -> None:
    r = run("zb-v", 4, 4)
    assert r.bubble.per_rank_span_time == 6
    assert r.span_idle == (6, 4, 2, 0)


@pytest.mark.parametrize("case", fitting_cases("dualpipe-v"), ids=ids)
def test_dualpipe_v(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    # Published: (p_s/2-1)(F&B+B-3W) with p_s = 2p stages and F&B = F+B (no overlap
    # gain). It assumes DualPipe's runtime, where an overlapped pair is one block: both
    # inputs received before it, both outputs sent after it; the block lowering does that.
    blocks = simulate(dualpipe_v_lowered(p, m))
    assert blocks.bubble.per_rank_span_time == pytest.approx((p - 1) * ((F + B) + B - 3 * W))
    assert blocks.idle == pytest.approx([(p - 1) * ((F + B) + B - 3 * W)] * p)
    assert blocks.peak_activations == (2 * p + 1,) * p
    # The plain schedule lets the pair's forward output leave when the forward ends,
    # which saves I per ramp step: (p-1)(F+B-2W).
    r = run("dualpipe-v", p, m)
    assert r.bubble.per_rank_span_time == pytest.approx((p - 1) * (F + B - 2 * W))
    assert r.idle == pytest.approx([(p - 1) * (F + B - 2 * W)] * p)
    assert r.peak_activations == (2 * p + 1,) * p


@pytest.mark.parametrize("case", [(p, m, None) for p, m in SIZES], ids=ids)
def test_naive_idles_all_but_one_rank(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("naive", p, m)
    assert r.bubble.idle_fraction == pytest.approx((p - 1) / p)
    assert r.idle == pytest.approx([(p - 1) * m * (F + B)] * p)
    assert r.peak_activations == (m,) * p


@pytest.mark.parametrize("case", fitting_cases("pipedream"), ids=ids)
def test_pipedream_stashes_p_minus_r_versions(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("pipedream", p, m)
    assert r.weight_versions == tuple(p - rank for rank in range(p))
    assert r.peak_activations == tuple(min(p - rank, m) for rank in range(p))


@pytest.mark.parametrize("case", fitting_cases("pipedream-2bw"), ids=ids)
def test_pipedream_2bw_keeps_two_versions(case: tuple[int, int, None]) -> None:
    p, m, _ = case
    r = run("pipedream-2bw", p, m)
    # Two buffers; the last rank runs each forward right before its backward, so no
    # micro-batch is in flight across an update there and one version is ever alive.
    assert r.weight_versions == (2,) * (p - 1) + (1,)
    assert all(a <= p - rank for rank, a in enumerate(r.peak_activations))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_chimera_one_unit_is_synchronous_and_holds_p_2_plus_1_to_p(p: int) -> None:
    # One basic unit (m = p): each direction carries m/2 micro-batches.
    r = run("chimera", p, p)
    assert r.weight_versions == (1,) * p
    assert all(p // 2 + 1 <= a <= p for a in r.peak_activations)
