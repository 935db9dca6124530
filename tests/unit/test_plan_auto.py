"""plan --auto: the pruned search keeps the exact top, a budget drops what does not fit and
says what it gave up, the winner's config loads, and llama3-70b on 64 ranks is fast."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.cli.plan_auto import HARDWARE, _write, auto_overrides
from pipetrain.config import load_config
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import AutoRequest, search
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.layouts import Hardware, enumerate_layouts
from pipetrain.partition.scoring import Scorer
from pipetrain.partition.split_sim import simulate_split
from pipetrain.schedules.actions import Kind
from pipetrain.schedules.early_grads import early_grads
from pipetrain.schedules.lowering import lower
from pipetrain.schedules.registry import get_spec

CPU = HARDWARE["cpu"]


def _costs_for(model: str, seq_len: int, hw: Hardware):
    config = get_model_config(model)

    def costs(tp: int, mb: int = 1):
        bandwidth = hw.tp_bandwidth if tp > 1 else None
        return estimate_costs(
            config, seq_len, flops_per_second=hw.flops, tp=tp, tp_bandwidth=bandwidth
        )

    return config, costs


def _exhaustive(model: str, req: AutoRequest, hw: Hardware) -> list[tuple[float, object]]:
    config, costs = _costs_for(model, req.seq_len, hw)
    scorer = Scorer(config, req, costs, hw)
    out = []
    for layout in enumerate_layouts(config, req):
        scored = scorer.evaluate(layout)
        if scored is not None and scored.fits:
            out.append((scored.step_time, layout))
    return sorted(out, key=lambda t: (t[0], str(t[1])))


@pytest.mark.parametrize(
    ("world", "cores", "per_action"), [(2, 0.0, 0.0), (4, 0.0, 0.0), (4, 2.0, 0.0), (4, 2.0, 1e-3)]
)
def test_pruning_keeps_the_exact_top_of_a_small_space(
    world: int, cores: float, per_action: float
) -> None:
    # cores 2: four processes share two cores, and the bound must stay below the
    # makespan that a bubble's freed cores shorten (sim/shared_cores.py); a cost per
    # action must not lift it above a layout's simulated step either.
    hw = replace(CPU, shared_cores=cores, per_action=per_action)
    req = AutoRequest(world, 8, 32, top=4)
    config, costs = _costs_for("llama-tiny", 32, hw)
    plan = search(config, req, costs, hw)
    every = _exhaustive("llama-tiny", req, hw)
    plain = [s for s in plan.ranked if not s.layout.early_grads]
    assert plan.pruned > 0  # the bound did cut the space
    assert [round(s.step_time, 12) for s in plain[:4]] == [round(t, 12) for t, _ in every[:4]]
    assert plain[0].layout == every[0][1] or plain[0].step_time == every[0][0]


def test_a_budget_drops_what_does_not_fit_and_says_what_it_gave_up() -> None:
    config, costs = _costs_for("llama-default", 128, CPU)
    free = search(config, AutoRequest(4, 32, 128), costs, CPU).winner
    assert free is not None
    limit = free.peak_bytes * 0.99
    plan = search(config, AutoRequest(4, 32, 128, memory_limit=limit), costs, CPU)
    assert plan.winner is not None
    assert all(s.peak_bytes <= limit for s in plan.ranked)
    assert plan.winner.step_time >= free.step_time
    given = plan.given_up
    assert given is not None and given.layout == free.layout and given.peak_bytes > limit
    # A budget no layout meets: none fits, and the search says so.
    tight = search(config, AutoRequest(4, 32, 128, memory_limit=1e5), costs, CPU)
    assert tight.winner is None and tight.ranked == ()


def test_the_top_layouts_round_trip_through_a_train_config(tmp_path: Path) -> None:
    config, costs = _costs_for("llama-default", 128, CPU)
    req = AutoRequest(4, 32, 128, grad_views=True)
    top = search(config, req, costs, CPU).ranked[:5]
    assert len(top) == 5
    # The gradients as bucket views where a layout has replicas (ties keep them).
    assert any(s.layout.grad_views for s in top)
    for scored in top:
        path = tmp_path / "auto.toml"
        _write(path, "llama-default", scored, req)
        loaded = load_config(path, check_paths=False)
        for key, value in auto_overrides(scored, req).items():
            section, name = key.split(".")
            assert getattr(getattr(loaded, section), name) == value, key
        assert loaded.pipeline.grad_as_bucket_view == scored.layout.grad_views
        assert loaded.model.name == "llama-default"
        assert loaded.pipeline.processes == 4


def _walked_peak(
    schedule,
    rank: int,
    acts: list[float],
    pending: list[float],
    freed: list[float],
    message: float,
) -> float:
    """The most bytes live on ``rank`` walking its actions in order: a micro-batch's
    activations from its F to its B, or to its I for the part no linear takes (``freed``)
    and to its W for the rest; its pending gradients from its I to its W, within the I
    only what exceeds the part it frees; from each B or I whose stage's previous stage is
    on another rank, the input gradient sent there (``message``) until this rank receives
    a message that rank sent after receiving it (``_acknowledged``), or the step ends."""
    placement = schedule.placement
    acknowledged = _acknowledged(schedule, rank)
    level = peak = 0.0
    held: set[tuple[int, int]] = set()
    for action in schedule.actions[rank]:
        stage = placement.model_stage(action.stage)
        if action.kind in (Kind.F, Kind.B, Kind.I):
            for sent in acknowledged.get((action.stage, action.microbatch, action.kind), ()):
                if sent in held:
                    held.discard(sent)
                    level -= message
        before = placement.prev_stage(action.stage)
        sends = before is not None and placement.rank_of(before) != rank
        if action.kind in (Kind.B, Kind.I) and sends:
            held.add((action.stage, action.microbatch))
            level += message  # after what the action frees: the peak is checked below
        if action.kind is Kind.F:
            level += acts[stage]
        elif action.kind is Kind.I:
            # Layer by layer the I queues output gradients as it frees saved tensors:
            # within it only the gradients beyond what it frees add up.
            excess = max(0.0, pending[stage] - freed[stage])
            peak = max(peak, level + excess)
            level += pending[stage] - freed[stage]
        elif action.kind is Kind.B:
            level -= acts[stage]
        elif action.kind is Kind.W:
            level -= acts[stage] - freed[stage] + pending[stage]
        peak = max(peak, level)
    return peak


def _acknowledged(schedule, rank: int) -> dict[tuple, list[tuple[int, int]]]:
    """The compute actions of ``rank`` -> the (stage, micro-batch) of its backwards whose
    sent gradient the message they take proves received: the peer sent that message after
    its RECV of the gradient (its program, lowered as the runtime lowers it)."""
    lowered = lower(schedule)
    placement = lowered.placement
    out: dict[tuple, list[tuple[int, int]]] = {}
    for peer, program in enumerate(lowered.actions):
        if peer == rank:
            continue
        got: list[tuple[int, int]] = []  # our backwards whose gradient the peer received
        for a in program:
            if a.kind is Kind.RECV_B and placement.rank_of(a.stage + 1) == rank:
                got.append((a.stage + 1, a.microbatch))
            elif got and a.kind in (Kind.SEND_F, Kind.SEND_B):
                dst = a.stage + 1 if a.kind is Kind.SEND_F else a.stage - 1
                if placement.rank_of(dst) == rank:
                    kind = Kind.F if a.kind is Kind.SEND_F else Kind.B
                    out.setdefault((dst, a.microbatch, kind), []).extend(got)
                    out.setdefault((dst, a.microbatch, Kind.I), []).extend(got)
                    got = []
    return out


def _formula_bytes(winner, config, seq_len: int, batch: int) -> float:
    """docs/memory_model.md's per-process formula for the winner's fullest process, from
    the model's sizes and the schedule's order of actions alone."""
    d, f, kv, vocab = config.d_model, config.ffn_hidden, config.kv_dim, config.vocab_size
    h, hd, lay = config.n_heads, config.head_dim, winner.layout
    t = lay.tp
    block_p = 2 * d + (2 * d * d + 2 * d * kv + 3 * d * f) // t
    embed_p, head_p = vocab * d // t, d + vocab * d // t
    per_token = hd + 2 * d + (4 * d + 2) + (3 * d + 2 * kv + h + 4 * f) / t
    block_a = 4 * seq_len * (per_token if not lay.recompute else d)
    embed_a, head_a = 4 * seq_len * 2, 4 * seq_len * (d + 2 * d + 1 + vocab / t + 2)
    mb = batch // lay.dp // lay.microbatches
    schedule = get_spec(lay.schedule).build(lay.pp, lay.microbatches, lay.chunks)
    schedule = early_grads(schedule) if lay.early_grads else schedule
    stages = len(winner.split)
    params = [winner.split[s] * block_p for s in range(stages)]
    acts = [winner.split[s] * block_a for s in range(stages)]
    params[0], acts[0] = params[0] + embed_p, acts[0] + embed_a
    params[-1], acts[-1] = params[-1] + head_p, acts[-1] + head_a
    rank = winner.peak_rank
    held = {schedule.placement.model_stage(v) for v in schedule.placement.stages_of(rank)}
    # A split backward holds its linears' output gradients from I to W (docs/memory_model.md):
    # q, k, v, gate and up split over tp, wo's and down's whole; the head's logits'.
    block_g = 4 * seq_len * ((d + 2 * kv + 2 * f) / t + 2 * d)
    pending = [winner.split[s] * block_g for s in range(stages)]
    pending[-1] += 4 * seq_len * vocab / t
    # I lets go of what no linear takes: the norms' outputs feed q, k, v and gate, up
    # (whole), attention's output wo and the SwiGLU product down (split); the head keeps
    # its norm's output; the lookup keeps nothing; a recomputed block its input.
    block_l = 4 * seq_len * (2 * d + (d + f) / t)
    freed = [0.0 if lay.recompute else winner.split[s] * (block_a - block_l) for s in range(stages)]
    freed[0] += embed_a
    freed[-1] += head_a - 4 * seq_len * d
    message = 4 * mb * seq_len * d
    live = _walked_peak(
        schedule,
        rank,
        [a * mb for a in acts],
        [g * mb for g in pending],
        [x * mb for x in freed],
        message,
    )
    state = (4 + (lay.dp > 1)) * 4 * sum(params[s] for s in held)
    full = 4 * seq_len * per_token
    transient = full * mb if lay.recompute and any(winner.split[s] for s in held) else 0.0
    # The running backward's gradients beside the saved tensors: a block's incoming one
    # and its MLP's three (and the row-wise linears' two queued by a split backward's I),
    # the head's logits' and log-softmax's; the rank's largest kind, for one micro-batch.
    split = any(a.kind is Kind.I for actions in schedule.actions for a in actions)
    running = []
    if any(winner.split[s] for s in held):
        running.append(d + 3 * f / t + (2 * d if split else 0))
    if stages - 1 in held:
        running.append(2 * vocab / t)
    in_backward = 4 * seq_len * mb * max(running, default=0.0)
    # Receives posted ahead from each neighbour, and the activation sent on to the next.
    messages = (rank > 0) + 2 * (rank < lay.pp - 1)
    return state + live + transient + in_backward + messages * message


def test_llama3_70b_on_64_ranks_is_planned_fast_and_matches_the_formula() -> None:
    hw = HARDWARE["h100"]
    config, costs = _costs_for("llama3-70b", 4096, hw)
    started = time.process_time()  # this process's CPU: other tests may share the cores
    plan = search(config, AutoRequest(64, 64, 4096, memory_limit=80 * 2**30), costs, hw)
    assert time.process_time() - started < 60
    winner = plan.winner
    assert winner is not None and winner.peak_bytes <= 80 * 2**30
    assert winner.layout.pp * winner.layout.dp * winner.layout.tp == 64
    expected = _formula_bytes(winner, config, 4096, 64)
    assert winner.peak_bytes == pytest.approx(expected, rel=1e-12)


def test_gradients_and_buckets_are_charged_where_the_timeline_meets_them() -> None:
    # One stage, one micro-batch, two replicas: the peak of the activations comes at the
    # end of the forward, the .grad tensors at the end of the backward that let go of
    # them, the dp buckets after it: the process holds the larger of the two, not both.
    from pipetrain.partition.layouts import Layout

    config, costs = _costs_for("llama-tiny", 32, HARDWARE["cpu"])
    scorer = Scorer(config, AutoRequest(2, 8, 32), costs, HARDWARE["cpu"])
    alone = scorer.evaluate(Layout("1f1b", 1, 2, 1, 1, 1, False, False))
    assert alone is not None
    (m,) = alone.memory
    assert m.unmet > 0
    assert m.unmet == pytest.approx(min(m.activations, m.gradients))
    assert m.total == pytest.approx(
        m.weights + m.optimizer + max(m.activations, m.gradients) + m.transient
        + m.in_backward + m.buffers + m.workspace
    )  # fmt: skip
    # 1F1B's steady state runs forwards after the first backward: its first rank's peak
    # holds the gradients beside the activations, as the count charges them (dp = 1).
    steady = scorer.evaluate(Layout("1f1b", 2, 1, 1, 1, 8, False, False))
    assert steady is not None and steady.memory[0].unmet == 0.0


def test_grads_as_bucket_views_hold_one_copy_all_step_and_are_chosen_where_lower() -> None:
    # pipeline.grad_as_bucket_view: the .grad tensors are views of persistent buckets, so a
    # replica holds one gradient copy from the step's start (beside every activation) and
    # no second one at its end.
    from pipetrain.partition.layouts import Layout

    chosen_views = []
    # 32 sequences of 32 at once: the activations outweigh a second gradient copy at the
    # step's end. 1 sequence of 8 at a time: they do not.
    for seq_len, batch, m in ((32, 64, 1), (8, 8, 4)):
        config, costs = _costs_for("llama-tiny", seq_len, CPU)
        scorer = Scorer(config, AutoRequest(2, batch, seq_len), costs, CPU)
        copied = scorer.evaluate(Layout("1f1b", 1, 2, 1, 1, m, False, False))
        viewed = scorer.evaluate(Layout("1f1b", 1, 2, 1, 1, m, False, False, grad_views=True))
        assert copied is not None and viewed is not None
        (c,), (v,) = copied.memory, viewed.memory
        assert v.gradients == pytest.approx(v.optimizer / 2) == pytest.approx(c.gradients / 2)
        assert v.unmet == 0.0
        assert v.total == pytest.approx(
            v.weights + v.optimizer + v.gradients + v.activations + v.transient
            + v.in_backward + v.buffers + v.workspace
        )  # fmt: skip
        assert viewed.step_time == copied.step_time
        # Asked to, the scorer keeps the views unless the process then holds more.
        request = AutoRequest(2, batch, seq_len, grad_views=True)
        chosen = Scorer(config, request, costs, CPU).evaluate(copied.layout)
        assert chosen is not None
        assert chosen.layout.grad_views == (v.total <= c.total)
        assert chosen.peak_bytes == pytest.approx(min(v.total, c.total))
        chosen_views.append(chosen.layout.grad_views)
    assert chosen_views == [False, True]
    small = Scorer(config, request, costs, CPU)
    # Never without replicas, nor under Chimera, whose own sum copies anyway.
    for layout in (Layout("1f1b", 2, 1, 1, 1, 4, False, False),
                   Layout("chimera", 2, 1, 1, 1, 2, False, False)):  # fmt: skip
        scored = small.evaluate(layout)
        assert scored is not None and not scored.layout.grad_views


def test_chimera_replicas_are_charged_the_flat_copies_they_all_reduce() -> None:
    # Each process of Chimera holds a stage of each pipeline and sums its gradients with
    # the other pipeline's replica through a flat copy (runtime/collectives.py), as dp's
    # buckets do: 4 more bytes a parameter, where 1F1B at dp = 1 has none.
    from pipetrain.partition.layouts import Layout

    config, costs = _costs_for("llama-tiny", 32, HARDWARE["cpu"])
    scorer = Scorer(config, AutoRequest(4, 8, 32), costs, HARDWARE["cpu"])
    chimera = scorer.evaluate(Layout("chimera", 4, 1, 1, 1, 4, False, False))
    plain = scorer.evaluate(Layout("1f1b", 4, 1, 1, 1, 4, False, False))
    assert chimera is not None and plain is not None
    # AdamW's state is 8 bytes a parameter: the .grad and its flat copy together are too.
    for m in chimera.memory:
        assert m.gradients == pytest.approx(m.optimizer) and m.gradients > 0
    for m in plain.memory:
        assert m.gradients == pytest.approx(m.optimizer / 2)


def test_a_cost_per_action_is_paid_by_every_f_b_i_and_w_once() -> None:
    from pipetrain.partition.layouts import Layout

    config, costs = _costs_for("llama-tiny", 32, CPU)
    a = 1e-3
    plain = Scorer(config, AutoRequest(2, 8, 32), costs, CPU)
    charged = Scorer(config, AutoRequest(2, 8, 32), costs, replace(CPU, per_action=a))

    def extra(layout: Layout) -> float:
        before, after = plain.evaluate(layout), charged.evaluate(layout)
        assert before is not None and after is not None
        return after.pipeline_time - before.pipeline_time

    # One process a replica, 4 micro-batches: an F and a B each, one after the other.
    assert extra(Layout("1f1b", 1, 2, 1, 1, 4, False, False)) == pytest.approx(8 * a)
    # A split backward is two actions: ZB-H1's ranks each run 4 F, 4 I and 4 W.
    zb = Layout("zb-h1", 2, 1, 1, 1, 4, False, False)
    busy = [
        simulate_split(s.schedule(zb), s.split_for_placement(zb, s.placement(zb)), 4,
                       per_action=s.hw.per_action).busy
        for s in (plain, charged)
    ]  # fmt: skip
    assert [y - x for x, y in zip(*busy, strict=True)] == pytest.approx([12 * a, 12 * a])
    # Naive model parallel: one action carries the whole batch, on each of 2 stages in turn.
    assert extra(Layout("naive", 2, 1, 1, 1, 4, False, False)) == pytest.approx(4 * a)


def test_bad_input_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli import main

    for argv, words in (
        (["plan", "--auto", "--model", "llama-tiny"], "--world-size"),
        (["plan", "--auto", "--model", "llama-tiny", "--world-size", "0"], "--world-size"),
        (
            ["plan", "--auto", "--model", "llama-tiny", "--world-size", "2", "--memory-limit", "x"],
            "--memory-limit",
        ),
        (["plan", "--model", "llama-tiny"], "--pp"),
        (
            [
                "plan",
                "--auto",
                "--model",
                "llama-tiny",
                "--world-size",
                "2",
                "--set",
                "n_layers=2",
                "--out",
                "x.toml",
            ],
            "--set",
        ),
    ):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, argv
        assert len(err.splitlines()) == 1 and words in err, err


def test_train_auto_replaces_the_layout_of_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import Namespace

    from pipetrain.cli.plan_auto import auto_config

    overrides = {"model.name": "llama-tiny", "data.batch_size": 8, "data.seq_len": 32}
    config = load_config(None, overrides, check_paths=False)
    args = Namespace(
        auto=True, world_size=2, memory_limit=None, hardware="cpu", measure=0, measure_steps=6
    )
    chosen = auto_config(config, args)
    assert "winner:" in capsys.readouterr().out
    assert chosen.pipeline.processes == 2
    assert (chosen.data, chosen.model, chosen.run) == (config.data, config.model, config.run)
