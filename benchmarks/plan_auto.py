"""Is ``plan --auto``'s choice right? Measure it against a sweep of layouts on this machine.

    .venv/bin/python benchmarks/plan_auto.py [--models llama-default,llama-wide]
        [--worlds 2,4] [--sweep 20] [--steps 6] [--rounds 3] [--calibrate-steps 8]
        [--calibrate-runs 3] [--confirm 3] [--top-rounds 0] [--budget 0.8] [--only-budget]
        [--out runs/plan_auto]

For each model and world size: per-layer costs are profiled once (``--balance profile``'s
machinery), the planner searches, and then every layout of a sweep (the ``--sweep``
layouts the planner predicts fastest, plus the default config's layout and the calibration's
reference layouts) is trained for ``--steps`` steps through the real launcher, once in
each of ``--rounds`` rounds (each round in its own shuffled order; a layout's figures are
the median over its rounds; ``--top-rounds`` more rounds of the five predicted fastest
alone follow, for the bar read on them). Printed, as markdown: each layout's predicted and
measured step time and peak model memory per process, then the acceptance figures (the
choice's measured tokens/s against the best measured and the default's; the predicted
step time's error on the five predicted fastest; the predicted peak's error), a
head-to-head where the choice is not the best measured (both trained ``--confirm`` more
times, alternating: the best of some twenty noisy medians is picked for being high, so
the sweep's own figure of it is biased up; fresh runs are not), and a budget run: a memory
limit of ``--budget`` times the default layout's predicted peak, the five fastest predicted
to fit under it trained as ``plan --auto --measure 5`` trains them, and the fastest whose
measured peak fits kept.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipetrain.cli.plan_auto import auto_overrides, explain, hardware_for
from pipetrain.cli.plan_calibrate import calibrate, reference_layouts, size_reference
from pipetrain.cli.plan_measure import (
    best_measured,
    lowered_limit,
    measure_layout,
    render_measured,
)
from pipetrain.cli.plan_profile import auto_costs
from pipetrain.heap import allocator_library
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import AutoRequest, Layout, Scored, search
from pipetrain.partition.scoring import Scorer

BATCH = 32


def _profile_args(world: int) -> argparse.Namespace:
    return argparse.Namespace(device="cpu", repeats=3, seed=0, world_size=world)


def _train(
    scored: Scored, request: AutoRequest, model: str, steps: int, out: Path, name: str
) -> dict[str, Any]:
    """Train a layout as ``plan --auto --measure`` does; its median step time after the
    first and memory check."""
    m = measure_layout(
        scored, auto_overrides(scored, request), model=model, steps=steps, out_dir=out, name=name
    )
    if not m.ok:
        return {"error": [m.error]}
    return {"step_time": m.step_time, "measured_peak": list(m.measured_peak)}


def _rounds(
    sweep: list[Scored], request: AutoRequest, model: str, world: int, args: argparse.Namespace,
    rounds: range, runs: dict[Layout, list[dict[str, Any]]],
) -> None:  # fmt: skip
    """Every layout of ``sweep`` trained once a round, each round in its own shuffled order
    (runs of one layout here differ by up to a third, and the machine drifts over minutes:
    no layout is always measured first); each run added to ``runs``."""
    for r in rounds:
        order = list(range(len(sweep)))
        random.Random(r).shuffle(order)
        for i in order:
            s = sweep[i]
            m = _train(s, request, model, args.steps, args.out, f"{model}-w{world}-r{r}-{i}")
            runs.setdefault(s.layout, []).append(m)
            said = m["error"][0] if "error" in m else f"{m['step_time'] * 1e3:.0f} ms"
            print(f"round {r + 1}: {s.layout.describe()}: {said}", file=sys.stderr, flush=True)


def _medians(
    request: AutoRequest, runs: dict[Layout, list[dict[str, Any]]]
) -> dict[Layout, dict[str, Any]]:
    """Per layout: the median step time over its runs and its tokens/s, the runs' step
    times, and the median peak per process (a layout whose runs all failed: its first)."""
    out: dict[Layout, dict[str, Any]] = {}
    for lay, done in runs.items():
        ok = [m for m in done if "error" not in m]
        if not ok:
            out[lay] = done[0]
            continue
        step = statistics.median(m["step_time"] for m in ok)
        peaks = zip(*(m["measured_peak"] for m in ok if m["measured_peak"]), strict=False)
        out[lay] = {
            "step_time": step,
            "tokens_per_s": request.batch_size * request.seq_len / step,
            "rounds": [m["step_time"] for m in ok],
            "measured_peak": [statistics.median(p) for p in peaks],
        }
    return out


def _head_to_head(
    pair: tuple[Scored, Scored],
    request: AutoRequest,
    model: str,
    world: int,
    args: argparse.Namespace,
) -> list[list[float]]:
    """The step times of both layouts of ``pair`` over ``args.confirm`` fresh runs each,
    alternating which goes first, after the sweep that selected them."""
    times: list[list[float]] = [[], []]
    for r in range(args.confirm):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            m = _train(pair[i], request, model, args.steps, args.out, f"{model}-w{world}-c{r}-{i}")
            said = m["error"][0] if "error" in m else f"{m['step_time'] * 1e3:.0f} ms"
            print(f"head to head {r + 1}: {pair[i].layout.describe()}: {said}", file=sys.stderr,
                  flush=True)  # fmt: skip
            if "error" not in m:
                times[i].append(m["step_time"])
    return times


def _confirm(
    choice: Scored, rival: Scored, request: AutoRequest, model: str, world: int,
    args: argparse.Namespace,
) -> None:  # fmt: skip
    """Print the head-to-head of the choice against the best measured layout."""
    times = _head_to_head((choice, rival), request, model, world, args)
    if not all(times):
        print("head to head: a run failed; no figure")
        return
    mine, theirs = (statistics.median(t) for t in times)
    runs = "; ".join(", ".join(f"{x * 1e3:.0f}" for x in t) for t in times)
    print(
        f"head to head, {args.confirm} fresh runs each, alternating (ms: {runs}): choice "
        f"{mine * 1e3:.0f} ms, {rival.layout.describe()} {theirs * 1e3:.0f} ms (medians): "
        f"choice = {theirs / mine:.3f} of it in tokens/s"
    )


def _default_layout(world: int) -> Layout:
    """pipetrain train's defaults (1F1B, 8 micro-batches, early gradients) on the world."""
    return Layout("1f1b", world, 1, 1, 1, 8, False, True)


def _planned_peaks(s: Scored) -> list[float]:
    """The planner's peak per process, in the launcher's rank order (tp, then dp, inside
    each pipeline rank), as the run's memory check lists its measurements."""
    group = s.layout.dp * s.layout.tp
    return [s.memory[r // group].total for r in range(s.layout.pp * group)]


def _row(s: Scored, m: dict[str, Any]) -> str:
    if "error" in m:
        said = (str(m["error"][0]).strip().splitlines() or ["no message"])[-1][:200]
        return f"| {s.layout.describe()} | {s.step_time * 1e3:.0f} | failed: {said} | | | |"
    pred_peak = max(_planned_peaks(s))
    meas_peak = max(m["measured_peak"] or [0])
    rounds = ", ".join(f"{t * 1e3:.0f}" for t in m["rounds"])
    return (
        f"| {s.layout.describe()} | {s.step_time * 1e3:.0f} | {m['step_time'] * 1e3:.0f} | "
        f"{rounds} | {m['tokens_per_s']:,.0f} | {pred_peak / 2**20:.1f} | {meas_peak / 2**20:.1f} |"
    )


def bench(model: str, world: int, args: argparse.Namespace) -> None:
    config = get_model_config(model)
    pargs = _profile_args(world)
    hw = hardware_for("cpu", world)
    request = AutoRequest(world, BATCH, args.seq_len, top=max(5, args.sweep), grad_views=True)
    costs_for, source, hw = auto_costs(pargs, config, args.seq_len, hw, request)
    if args.calibrate_steps:
        costs_for, hw, said = calibrate(
            config, model, request, costs_for, hw, steps=args.calibrate_steps,
            runs=args.calibrate_runs, measure=measure_layout, overrides_of=auto_overrides,
        )  # fmt: skip
        source += said
    plan = search(config, request, costs_for, hw)
    scorer = Scorer(config, request, costs_for, hw)
    sweep = list(plan.ranked[: args.sweep])
    default = scorer.evaluate(_default_layout(world))
    # The calibration's reference layout is trained in every round too: measured beside
    # the sweep, it shows how far the machine moved since the calibration runs set the
    # scale (a drift that no prediction made before the sweep can see).
    sized = size_reference(request)
    references = [
        scorer.evaluate(lay) for lay in (*reference_layouts(request), *([sized] if sized else []))
    ]
    for extra in (default, *references):
        if extra is not None and extra.layout not in {s.layout for s in sweep}:
            sweep.append(extra)
    print(f"\n### {model}, {world} processes, batch {BATCH} x {args.seq_len}\n\ncosts {source}\n")
    if args.only_budget:
        if default is not None:
            _budget(config, model, world, request, costs_for, hw, default, args)
        return
    runs: dict[Layout, list[dict[str, Any]]] = {}
    _rounds(sweep, request, model, world, args, range(args.rounds), runs)
    # The bar on the five predicted fastest is read on their medians: more runs of them,
    # in rounds of their own after the sweep's, where asked.
    top = [s for s in plan.ranked[:5] if s in sweep]
    _rounds(
        top, request, model, world, args, range(args.rounds, args.rounds + args.top_rounds), runs
    )
    measured = _medians(request, runs)
    print(
        "| layout | predicted ms | measured ms (median) | rounds, ms | tokens/s | "
        "predicted MiB | measured MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for s in sweep:
        print(_row(s, measured[s.layout]))
    ok = {lay: m for lay, m in measured.items() if "error" not in m}
    best_layout = max(ok, key=lambda lay: ok[lay]["tokens_per_s"])
    best = ok[best_layout]["tokens_per_s"]
    choice = ok.get(plan.ranked[0].layout)
    if choice is not None:
        print(f"\nchoice {plan.ranked[0].layout.describe()}: {choice['tokens_per_s']:,.0f} tokens/s = "
              f"{choice['tokens_per_s'] / best:.3f} of the best measured ({best:,.0f})")  # fmt: skip
        if default is not None and default.layout in ok:
            d = ok[default.layout]["tokens_per_s"]
            print(
                f"default {default.layout.describe()}: {d:,.0f} tokens/s (choice / default {choice['tokens_per_s'] / d:.3f})"
            )
    # plan --auto --measure 5 trains the five predicted fastest once each and keeps the
    # fastest of them: it sees the first round's runs; what it picked is judged by the
    # pick's median over the rounds, as every layout is.
    top5 = [ok[s.layout] | {"layout": s.layout} for s in plan.ranked[:5] if s.layout in ok]
    if top5:
        pick = min(top5, key=lambda m: m["rounds"][0])
        print(f"with --measure 5: {pick['layout'].describe()}, {pick['tokens_per_s']:,.0f} tokens/s = "
              f"{pick['tokens_per_s'] / best:.3f} of the best measured")  # fmt: skip
    errors = [
        abs(s.step_time / ok[s.layout]["step_time"] - 1) for s in plan.ranked[:5] if s.layout in ok
    ]
    print(
        f"predicted step time error, five predicted fastest: max {max(errors):.1%}, mean {statistics.mean(errors):.1%}"
    )
    _drift_out(plan.ranked[:5], ok, references, scorer)
    planned = {s.layout: s for s in sweep}
    mem = [
        abs(p / m - 1)
        for lay, r in ok.items()
        for p, m in zip(_planned_peaks(planned[lay]), r["measured_peak"], strict=False)
        if m > 0
    ]
    if mem:
        print(
            f"predicted peak memory error per process: max {max(mem):.1%}, mean {statistics.mean(mem):.1%}"
        )
    for reference in references:
        if reference is None or reference.layout not in ok:
            continue
        r = ok[reference.layout]
        print(
            f"the calibration's reference {reference.layout.describe()} in the sweep: predicted "
            f"{reference.step_time * 1e3:.0f} ms, measured {r['step_time'] * 1e3:.0f} ms "
            f"({r['step_time'] / reference.step_time:.3f}x the prediction it set)"
        )
    if choice is not None and best_layout != plan.ranked[0].layout and args.confirm:
        rival = next(s for s in sweep if s.layout == best_layout)
        _confirm(plan.ranked[0], rival, request, model, world, args)
    if default is not None:
        _budget(config, model, world, request, costs_for, hw, default, args)


def _drift_out(top: list[Scored], ok: dict[Layout, dict[str, Any]],
               references: list[Scored | None], scorer: Scorer) -> None:  # fmt: skip
    """The top five's error with the machine's drift taken out, a diagnostic (the planner
    cannot see a drift that comes after it): each round's measurement divided by that
    round's measured-over-predicted of the reference nearest in micro-batch size."""
    refs = [r for r in references if r is not None and r.layout in ok]
    errors = []
    for s in top:
        if s.layout not in ok or not refs:
            continue
        size = scorer.microbatch_size(s.layout)
        ref = min(refs, key=lambda r: abs(math.log(scorer.microbatch_size(r.layout) / size)))
        pairs = zip(ok[s.layout]["rounds"], ok[ref.layout]["rounds"], strict=False)
        corrected = statistics.median(t * ref.step_time / r for t, r in pairs)
        errors.append(abs(s.step_time / corrected - 1))
    if errors:
        print(f"  with each round's drift of the nearest reference taken out: max "
              f"{max(errors):.1%}, mean {statistics.mean(errors):.1%}")  # fmt: skip


def _budget(config: Any, model: str, world: int, request: AutoRequest, costs_for: Any, hw: Any,
            default: Scored, args: argparse.Namespace) -> None:  # fmt: skip
    limit = default.peak_bytes * args.budget
    plan = search(config, replace(request, memory_limit=limit, top=5), costs_for, hw)
    print(f"\nbudget {limit / 2**20:.1f} MiB ({args.budget} x the default's predicted peak):")
    for line in explain(plan):
        print(f"    {line}")
    if plan.winner is None:
        return
    # What --measure 5 does under the budget: the five fastest predicted to fit, trained,
    # and the fastest whose measured peak fits kept; where none does, planned again under
    # the limit less the most one went over, and that plan's five measured.
    measured = _budget_round(plan, limit, model, world, args, "budget")
    first = measured[0]
    if first.ok:
        peak = max(first.measured_peak)
        print(f"    the predicted winner measured: {first.tokens_per_s:,.0f} tokens/s, peak "
              f"{peak / 2**20:.1f} MiB ({'fits' if peak <= limit else 'OVER the budget'})")  # fmt: skip
    best = best_measured(measured, limit)
    lowered = lowered_limit(measured, limit) if best is None else None
    if lowered is not None:
        again = search(config, replace(request, memory_limit=lowered, top=5), costs_for, hw)
        print(f"    none fits as measured: planning again under {lowered / 2**20:.1f} MiB")
        for line in explain(again):
            print(f"    {line}")
        if again.winner is not None:
            runs = _budget_round(again, limit, model, world, args, "budget-again")
            best = best_measured(runs, limit)
    if best is not None:
        peak = max(best.measured_peak)
        print(f"    with --measure 5: {best.scored.layout.describe()}, {best.tokens_per_s:,.0f} "
              f"tokens/s, peak {peak / 2**20:.1f} MiB (fits, measured)")  # fmt: skip


def _budget_round(plan: Any, limit: float, model: str, world: int, args: argparse.Namespace,
                  name: str) -> list[Any]:  # fmt: skip
    """The plan's five fastest trained once each, the table of predicted and measured
    (against the user's ``limit``)."""
    measured = [
        measure_layout(
            s, auto_overrides(s, plan.request), model=model, steps=args.steps,
            out_dir=args.out, name=f"{model}-w{world}-{name}-{i}",
        )
        for i, s in enumerate(plan.ranked[:5])
    ]  # fmt: skip
    for line in render_measured(measured, limit).splitlines():
        print(f"    {line}")
    return measured


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-default,llama-wide")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--sweep", type=int, default=20)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--calibrate-steps", type=int, default=8, help="0: no calibration run")
    p.add_argument("--calibrate-runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="each layout measured once a round")
    p.add_argument("--confirm", type=int, default=3,
                   help="fresh runs each of the choice and the best measured, head to head")  # fmt: skip
    p.add_argument("--top-rounds", type=int, default=0,
                   help="more rounds of the five predicted fastest alone, after the sweep's")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--budget", type=float, default=0.8)
    p.add_argument("--only-budget", action="store_true", help="skip the sweep: the budget runs")
    p.add_argument(
        "--out", type=Path, default=Path("runs/plan_auto") / time.strftime("%Y%m%d-%H%M%S")
    )
    args = p.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f} (1 min) at start")
    # The ranks' C heap is what their resident peaks measure (docs/memory_model.md).
    print(f"ranks' C allocator (run.allocator=auto): {allocator_library('auto') or 'glibc'}")
    for model in args.models.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            bench(model, world, args)
    print(f"\nload: {os.getloadavg()[0]:.1f} (1 min) at the end")


if __name__ == "__main__":
    main()
