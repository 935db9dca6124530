"""plan --auto's calibration run: the reference layout, and the compute scaled so that the
reference's prediction meets its measured step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from pipetrain.cli.plan_auto import HARDWARE, auto_overrides
from pipetrain.cli.plan_calibrate import calibrate, factor_at, reference_layouts, size_reference
from pipetrain.models.config import get_model_config
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layer_costs import scaled_times
from pipetrain.partition.layouts import AutoRequest, Layout
from pipetrain.partition.scoring import Scorer

# As a profile leaves it: the per-call part inside the layer costs, no fixed part on top.
CPU = replace(HARDWARE["cpu"], shared_cores=2.0, per_layer=0.0)


@dataclass(frozen=True)
class _Run:
    step_time: float
    error: str = ""
    measured_peak: tuple[int, ...] = ()
    dp_wait: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error


def _costs(tp: int, mb: int = 1) -> Any:
    return estimate_costs(get_model_config("llama-tiny"), 32, flops_per_second=CPU.flops, tp=tp)


def test_the_references_are_every_process_a_replica_at_micro_batches_near_4_and_16() -> None:
    first = reference_layouts(AutoRequest(4, 32, 32))[0]
    assert first == Layout("1f1b", 1, 4, 1, 1, 2, False, False)
    first = reference_layouts(AutoRequest(2, 32, 32))[0]
    assert first == Layout("1f1b", 1, 2, 1, 1, 4, False, False)
    # 8 samples a process: sizes 4 and 8 (the nearest to 16); 16 a process: 4 and 16.
    assert [lay.microbatches for lay in reference_layouts(AutoRequest(4, 32, 32))] == [2, 1]
    assert [lay.microbatches for lay in reference_layouts(AutoRequest(2, 32, 32))] == [4, 1]
    assert [lay.microbatches for lay in reference_layouts(AutoRequest(2, 2, 32))] == [1]
    assert reference_layouts(AutoRequest(3, 32, 32)) == ()


def test_the_factor_between_two_calibrated_sizes_follows_the_logarithm_of_the_size() -> None:
    factors = {4: 0.8, 16: 1.2}
    assert factor_at(factors, 4) == 0.8 and factor_at(factors, 16) == 1.2
    assert factor_at(factors, 8) == pytest.approx(1.0)  # halfway in log2
    assert factor_at(factors, 1) == 0.8 and factor_at(factors, 64) == 1.2  # the nearest's
    assert factor_at({4: 0.9}, 32) == 0.9


def test_the_calibrated_references_predict_their_measured_steps() -> None:
    config = get_model_config("llama-tiny")
    req = AutoRequest(4, 32, 32)
    first, second = reference_layouts(req)  # micro-batches of 4 and of 8
    before = Scorer(config, req, _costs, CPU)
    seen: dict[str, Any] = {}
    sized = size_reference(req)  # 8 samples a replica: micro-batches of 16 on 2 stages
    assert sized == Layout("gpipe", 2, 2, 1, 1, 1, False, False)
    # Three runs each, alternating, the median counted: the slow outlier moves nothing.
    scales = {
        first: iter([1.5, 3.0, 1.4]), second: iter([0.9, 1.0, 2.0]), sized: iter([1.3] * 3)
    }  # fmt: skip
    order = []

    def measure(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        if scored.layout.pp == 1:
            seen.update(overrides)
        seen.setdefault("names", []).append(kw["name"])
        order.append(scored.layout)
        if scored.layout not in scales:  # the pipelined reference: as fast as predicted
            return _Run(before.evaluate(scored.layout).step_time)
        return _Run(before.evaluate(scored.layout).step_time * next(scales[scored.layout]))

    costs, hw, said = calibrate(
        config, "llama-tiny", req, _costs, CPU, steps=5, measure=measure,
        overrides_of=auto_overrides,
    )  # fmt: skip
    # Pipelined at micro-batches of 4 too: 2 stages a rank, as llama-tiny cannot be cut in 8.
    piped = Layout("interleaved-1f1b", 2, 2, 1, 2, 4, False, False)
    assert order == [first, second, piped, sized] * 3
    after = Scorer(config, req, costs, hw)
    # Each replica reference's prediction meets its median run (the all-reduce is not
    # scaled, so the step is near, not at, its measured multiple); the size reference's
    # meets it to the bisection's precision.
    for layout, scale in ((first, 1.5), (second, 1.0)):
        assert after.evaluate(layout).step_time == pytest.approx(
            before.evaluate(layout).step_time * scale, rel=0.05
        )
    assert after.evaluate(sized).step_time == pytest.approx(
        before.evaluate(sized).step_time * 1.3, rel=1e-6
    )
    assert seen["pipeline.dp"] == 4 and seen["pipeline.pp"] == 1
    assert len(set(seen["names"])) == 12  # each run its own folder: metrics refuse reuse
    assert (
        "calibrated by 1f1b pp=1 dp=4 tp=1 m=2" in said and "; by 1f1b pp=1 dp=4 tp=1 m=1" in said
    )
    assert "over 5 steps (median of 3 runs)" in said
    # The pipelined run was slower than predicted by less than nothing: no cost an action.
    assert "each action (F, B, I or W) 0.00 ms beyond its layers" in said
    assert "memory not calibrated" in said and hw == CPU
    # Between the two sizes the factor follows the logarithm of the size.
    low, high = costs(1, 4)[1].forward / _costs(1, 4)[1].forward, costs(1, 8)[1].forward
    high /= _costs(1, 8)[1].forward
    assert low > high
    assert costs(1, 2)[1].forward / _costs(1, 2)[1].forward == pytest.approx(low)
    # The size reference's own factor at 16 (it ran 1.3x its prediction), and beyond it.
    top = costs(1, 16)[1].forward / _costs(1, 16)[1].forward
    assert top > high and "at micro-batch 16" in said
    assert costs(1, 32)[1].forward / _costs(1, 32)[1].forward == pytest.approx(top)
    assert size_reference(AutoRequest(2, 32, 32)) is None  # 16 a replica: pp = 1 reaches it
    assert size_reference(AutoRequest(3, 36, 32)) is None  # the processes do not pair up
    # Every layer's compute moves by the same factor: the memory and the shape stay.
    a, b = _costs(1, 4), costs(1, 4)
    ratio = b[1].forward / a[1].forward
    assert ratio > 1.0
    for x, y in zip(a, b, strict=True):
        assert y.backward == pytest.approx(x.backward * ratio)
        assert y.activation_bytes_per_sample == x.activation_bytes_per_sample


def test_a_failed_reference_run_leaves_the_profile_as_it_was() -> None:
    config = get_model_config("llama-tiny")
    req = AutoRequest(2, 32, 32)
    costs, hw, said = calibrate(
        config, "llama-tiny", req, _costs, CPU, steps=5,
        measure=lambda *a, **k: _Run(float("nan"), error="boom"), overrides_of=auto_overrides,
    )  # fmt: skip
    assert costs is _costs and hw is CPU and "not calibrated" in said and "boom" in said


def test_what_real_processes_hold_beyond_the_count_refits_the_workspace() -> None:
    config = get_model_config("llama-tiny")
    req = AutoRequest(2, 32, 32)
    hw0 = replace(CPU, memory_overhead=(0.2, 1e6), recompute_overhead=(1.5, 2e6))
    scorer = Scorer(config, req, _costs, hw0)
    first, second = reference_layouts(req)  # micro-batches of 4 and of 16: 4x in flight
    in_flight = {lay: scorer.evaluate(lay).memory[0].in_flight for lay in (first, second)}
    assert in_flight[second] == pytest.approx(4 * in_flight[first])
    # Beyond its count, a real process holds 3e6 bytes and 10% of the micro-batch in
    # flight; one run of each replica reference (they alternate) is an outlier the median
    # drops. The pipelined reference's processes count too, each against its own rank's
    # count (the fullest measured is fitted).
    noise = {first: iter([0.0, -1e5, 9e6]), second: iter([0.0, 9e6, -1e5])}
    fitted = []

    def measure(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        memory = scorer.evaluate(scored.layout).memory  # per pipeline rank
        processes = scored.layout.pp * scored.layout.dp
        extra = next(noise[scored.layout]) if scored.layout in noise else 0.0
        fitted.append(scored.layout)
        peaks = []
        for i in range(processes):
            m = memory[i * len(memory) // processes]
            peaks.append(int(m.total - m.workspace + 3e6 + 0.1 * m.in_flight + extra))
        if scored.layout in noise:
            peaks[0] -= 10**6  # a replica that holds less: the fullest one counts
        return _Run(1.0, measured_peak=tuple(peaks))

    _, hw, said = calibrate(
        config, "llama-tiny", req, _costs, hw0, steps=5, measure=measure,
        overrides_of=auto_overrides,
    )  # fmt: skip
    assert hw.memory_overhead == pytest.approx((0.1, 3e6), rel=0.02)
    assert any(lay.pp == 2 for lay in fitted)  # the pipelined reference ran
    assert "a process held beyond the count 3, 3, 3 MiB" in said  # three references
    # The recomputing workspace keeps its fraction and moves by the same bytes.
    assert hw.recompute_overhead == pytest.approx((1.5, 2e6 + 3e6 - 1e6), rel=0.02)
    assert "workspace 10% of the micro-batch in flight and 2.9 MiB a process" in said
    assert "(the profile's step: 20% and 1.0 MiB)" in said
    # Every layout is charged the refitted workspace.
    layout = Layout("1f1b", 2, 1, 1, 1, 4, False, False)
    after = Scorer(config, req, _costs, hw).evaluate(layout).memory
    plain = Scorer(config, req, _costs, hw0).evaluate(layout).memory
    for a, p in zip(after, plain, strict=True):
        assert a.workspace == pytest.approx(hw.memory_overhead[0] * p.in_flight
                                            + hw.memory_overhead[1])  # fmt: skip
        assert a.total - a.workspace == pytest.approx(p.total - p.workspace)


def test_one_reference_keeps_the_profiles_fraction_and_fits_the_bytes() -> None:
    config = get_model_config("llama-tiny")
    req = AutoRequest(2, 2, 32)  # one sample a process: one reference
    hw0 = replace(CPU, memory_overhead=(0.2, 1e6))
    scorer = Scorer(config, req, _costs, hw0)

    def measure(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        m = scorer.evaluate(scored.layout).memory[0]
        return _Run(1.0, measured_peak=(int(m.total - m.workspace + 0.2 * m.in_flight + 5e6),))

    _, hw, _ = calibrate(
        config, "llama-tiny", req, _costs, hw0, steps=5, measure=measure,
        overrides_of=auto_overrides,
    )  # fmt: skip
    assert hw.memory_overhead == pytest.approx((0.2, 5e6), rel=1e-3)


def test_a_pipelined_reference_recovers_the_cost_of_an_action() -> None:
    # The machine: the profile's compute x 1.3 and 2 ms an action on top (F, B, I or W).
    config = get_model_config("llama-default")
    req = AutoRequest(2, 32, 128)

    def costs(tp: int, mb: int = 1) -> Any:
        return estimate_costs(config, 128, flops_per_second=CPU.flops, tp=tp)

    def slower(tp: int, mb: int = 1) -> Any:
        return scaled_times(costs(tp, mb), 1.3)

    machine = Scorer(config, req, slower, replace(CPU, per_action=2e-3))
    seen = []

    def measure(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        seen.append(scored.layout)
        return _Run(machine.rescore(scored).step_time)  # trained at its split

    fitted, hw, said = calibrate(
        config, "llama-default", req, costs, CPU, steps=5, measure=measure,
        overrides_of=auto_overrides, runs=1,
    )  # fmt: skip
    # 4 stages a rank of llama-default's 14 layers, micro-batches of 4 as the first
    # reference's: 64 actions a rank where that reference runs 8.
    assert seen[-1] == Layout("interleaved-1f1b", 2, 1, 1, 4, 8, False, False)
    assert hw.per_action == pytest.approx(2e-3, rel=1e-3)
    assert "each action (F, B, I or W) 2.00 ms beyond its layers" in said
    # The compute is scaled back to the machine's, and every layout predicted as it runs.
    assert "compute x 1.30 at micro-batch 4, 1.30 at micro-batch 16" in said
    after = Scorer(config, req, fitted, hw)
    for layout in (Layout("zb-v", 2, 1, 1, 2, 8, False, False), seen[0], seen[-1]):
        scored = after.evaluate(layout)
        assert scored is not None
        assert scored.step_time == pytest.approx(machine.rescore(scored).step_time, rel=1e-3)


def test_the_replicas_waits_refit_the_all_reduce_and_leave_the_compute_as_the_machines() -> None:
    # The machine: the profile's compute, but its all-reduces 3x slower over 4 ranks and
    # 2x over 2 than the profile's links say (replicas that finish apart wait longer).
    config = get_model_config("llama-default")
    req = AutoRequest(4, 32, 128)
    links = ((2, 1e-3, 1e9), (4, 2e-3, 1e9))
    hw0 = replace(CPU, allreduce=links, overlap_comm=False)
    slow = replace(hw0, allreduce=((2, 1e-3, 0.5e9), (4, 2e-3, 1e9 / 3)))

    def costs(tp: int, mb: int = 1) -> Any:
        return estimate_costs(config, 128, flops_per_second=CPU.flops, tp=tp)

    machine = Scorer(config, req, costs, slow)

    def measure(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        run = machine.rescore(scored)
        wait = (run.dp_time,) if scored.layout.dp > 1 else ()
        return _Run(run.step_time, dp_wait=wait)

    def unreported(scored: Any, overrides: dict[str, Any], **kw: Any) -> _Run:
        return replace(measure(scored, overrides), dp_wait=())

    fitted, hw, said = calibrate(
        config, "llama-default", req, costs, hw0, steps=5, measure=measure,
        overrides_of=auto_overrides, runs=1,
    )  # fmt: skip
    assert dict((g, bw) for g, _, bw in hw.allreduce) == pytest.approx({2: 0.5e9, 4: 1e9 / 3})
    assert "4 ranks 0.33 GB/s (measured waits 3.00x the profile's 1.00 GB/s)" in said
    assert "compute x 1.00 at micro-batch 4, 1.00 at micro-batch 8" in said
    after = Scorer(config, req, fitted, hw)
    for layout in (Layout("1f1b", 4, 1, 1, 1, 8, False, False),  # no replicas
                   Layout("zb-h1", 2, 2, 1, 1, 4, False, False),
                   Layout("1f1b", 1, 4, 1, 1, 2, False, False)):  # fmt: skip
        scored = after.evaluate(layout)
        assert scored is not None
        assert scored.step_time == pytest.approx(machine.rescore(scored).step_time, rel=1e-3)
    # Unreported waits land in the compute: the layout without replicas predicted slower.
    fitted, hw, said = calibrate(
        config, "llama-default", req, costs, hw0, steps=5, measure=unreported,
        overrides_of=auto_overrides, runs=1,
    )  # fmt: skip
    assert hw.allreduce == links and "refitted" not in said
    scored = Scorer(config, req, fitted, hw).evaluate(Layout("1f1b", 4, 1, 1, 1, 8, False, False))
    assert scored is not None and scored.step_time > 1.01 * machine.rescore(scored).step_time
