"""plan --auto over expert parallelism: MoE models' layouts get an ep degree inside dp,
an ep rank holds its share of the experts and pays the all-to-alls, and a budget that
only sharded experts meet is met by sharding them (no processes here)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipetrain.cli.plan_auto import HARDWARE, _write, auto_overrides
from pipetrain.config import load_config
from pipetrain.models.config import get_model_config
from pipetrain.partition.auto import AutoRequest, search
from pipetrain.partition.estimate import estimate_costs
from pipetrain.partition.expert_costs import expert_parallel_costs
from pipetrain.partition.layouts import Layout, enumerate_layouts
from pipetrain.partition.scoring import Scorer

CPU = HARDWARE["cpu"]
SEQ = 32


def _costs(model: str):
    config = get_model_config(model)

    def costs(tp: int, mb: int = 1):
        return estimate_costs(config, SEQ, flops_per_second=CPU.flops, tp=tp)

    return config, costs


def test_moe_layouts_get_every_ep_that_divides_dp_and_the_experts() -> None:
    config, _ = _costs("moe-tiny")  # 4 experts a MoE layer
    seen = {(lay.dp, lay.ep) for lay in enumerate_layouts(config, AutoRequest(4, 8, SEQ))}
    assert {(4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)} <= seen
    assert all(dp % ep == 0 for dp, ep in seen)
    dense = get_model_config("llama-tiny")
    assert {lay.ep for lay in enumerate_layouts(dense, AutoRequest(4, 8, SEQ))} == {1}


def test_an_ep_rank_holds_its_share_of_the_experts_and_pays_the_alltoalls() -> None:
    config, costs = _costs("moe-tiny")
    one = list(costs(1))
    two = expert_parallel_costs(
        one, config, SEQ, tp=1, ep=2, flops_per_second=CPU.flops, ep_bandwidth=1e9
    )
    assert (
        expert_parallel_costs(
            one, config, SEQ, tp=1, ep=1, flops_per_second=CPU.flops, ep_bandwidth=1e9
        )
        == one
    )
    direct = estimate_costs(config, SEQ, flops_per_second=CPU.flops, ep=2, ep_bandwidth=1e9)
    for i, (a, b, want) in enumerate(zip(one, two, direct, strict=True)):
        moe = a.kind == "block" and config.is_moe_block(i - 1)
        # On estimated costs the difference taken is the estimate at ep 2 itself.
        assert b.forward == pytest.approx(want.forward)
        assert b.backward_input == pytest.approx(want.backward_input)
        assert b.param_bytes == want.param_bytes
        assert (b.param_bytes < a.param_bytes and b.forward > a.forward) == moe
        assert b.backward_weight == a.backward_weight
        assert b.activation_bytes_per_sample == a.activation_bytes_per_sample
    # Measured costs keep their compute: only the all-to-alls and the experts move.
    doubled = [replace(c, forward=2 * c.forward) for c in one]
    moved = expert_parallel_costs(
        doubled, config, SEQ, tp=1, ep=2, flops_per_second=CPU.flops, ep_bandwidth=1e9
    )
    for o, a, b, c in zip(one, doubled, moved, two, strict=True):
        assert b.forward - a.forward == pytest.approx(c.forward - o.forward)


def test_sharded_experts_win_where_they_are_faster_and_the_config_says_ep(
    tmp_path: Path,
) -> None:
    # moe-default's experts are most of its parameters: an ep rank all-reduces and
    # updates a quarter of them, which outweighs its all-to-alls here.
    config, costs = _costs("moe-default")
    hw = replace(CPU, shared_cores=0.0)
    req = AutoRequest(4, 16, SEQ, top=5)
    scorer = Scorer(config, req, costs, hw)
    base = Layout("1f1b", 1, 4, 1, 1, 1, False, False)
    plain, sharded = scorer.evaluate(base), scorer.evaluate(replace(base, ep=4))
    assert sharded.peak_bytes < plain.peak_bytes and sharded.dp_time < plain.dp_time
    assert sharded.update_time < plain.update_time
    plan = search(config, req, costs, hw)
    assert plan.winner is not None and plan.winner.layout.ep > 1
    unsharded = [
        s for s in (scorer.evaluate(lay) for lay in enumerate_layouts(config, req))
        if s is not None and s.layout.ep == 1
    ]  # fmt: skip
    assert plan.winner.step_time < min(s.step_time for s in unsharded)
    assert auto_overrides(plan.winner, plan.request)["pipeline.ep"] == plan.winner.layout.ep
    out = tmp_path / "auto.toml"
    _write(out, "moe-default", plan.winner, plan.request)
    assert load_config(out).pipeline.ep == plan.winner.layout.ep
    assert f" ep={plan.winner.layout.ep} " in plan.winner.layout.describe()


def test_pruning_keeps_the_exact_top_with_ep_in_the_space() -> None:
    config, costs = _costs("moe-tiny")
    for hw in (replace(CPU, shared_cores=0.0), replace(CPU, shared_cores=2.0)):
        req = AutoRequest(4, 8, SEQ, top=4)
        scorer = Scorer(config, req, costs, hw)
        every = sorted(
            s.step_time
            for s in (scorer.evaluate(lay) for lay in enumerate_layouts(config, req))
            if s is not None and s.fits
        )
        plan = search(config, req, costs, hw)
        plain = [s for s in plan.ranked if not s.layout.early_grads]
        assert [round(s.step_time, 12) for s in plain[:4]] == [round(t, 12) for t in every[:4]]


def test_plan_auto_json_is_one_object_with_the_winner_and_its_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import json

    from pipetrain.cli import main

    out = tmp_path / "auto.toml"
    argv = ["plan", "--auto", "--model", "moe-tiny", "--world-size", "4", "--batch-size", "8",
            "--seq-len", "32", "--top", "3", "--json", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)  # nothing else on stdout
    assert got["model"] == "moe-tiny" and got["world_size"] == 4
    assert len(got["ranked"]) == 3 and got["winner"] == got["ranked"][0]
    winner = got["winner"]
    assert winner["step_time_s"] > 0 and winner["peak_bytes"] == max(
        m["total"] for m in winner["memory"]
    )
    assert got["config"]["pipeline.ep"] == winner["layout"]["ep"]
    assert got["explain"][0].startswith("winner: ")
    assert "wrote" in captured.err and load_config(out).pipeline.ep == winner["layout"]["ep"]
