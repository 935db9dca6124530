"""The planner's memory model with tensor parallelism (docs/memory_model.md), checked
against numbers computed by hand, and its refusals of sizes tp cannot split."""

from __future__ import annotations

import json

import pytest

from pipetrain.cli import main
from pipetrain.models.config import get_model_config
from pipetrain.partition.estimate import estimate_costs, layer_params
from pipetrain.sim.tensor_parallel import TensorParallelError, layer_collectives, tp_time

CASE = "--model llama3-8b --pp 4 --tp 2 --seq-len 2048 --batch-size 8 --microbatches 8"


def _plan(capsys: pytest.CaptureFixture[str], flags: str) -> tuple[int, str, str]:
    code = main(["plan", *flags.split()])
    out, err = capsys.readouterr()
    return code, out, err


def test_llama3_8b_pp4_tp2_matches_the_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    # llama3-8b: d = 4096, f = 14336, kv = 8 * 128 = 1024, h = 32, head_dim = 128,
    # V = 128256; 32 blocks, uniform over 4 stages: 8 each, embed on 0, head on 3.
    # Parameters per tp rank (matrices / 2, norms whole):
    #   block = 2*4096 + (2*4096^2 + 2*4096*1024 + 3*4096*14336) / 2
    #         = 8192 + (33554432 + 8388608 + 176160768) / 2 = 109060096
    #   embed = 128256*4096 / 2 = 262668288;  head = 4096 + 262668288 = 262672384
    # State: 16 bytes a parameter (fp32 weight, gradient, two AdamW moments):
    #   rank 0: 16 * (262668288 + 8*109060096) = 16 * 1135149056 = 18162384896
    #   ranks 1, 2: 16 * 872480768 = 13959692288
    #   rank 3: 16 * (872480768 + 262672384) = 16 * 1135153152 = 18162450432
    # Activations per token of a block (no sequence parallelism):
    #   whole 128 + 2*4096 + (4*4096 + 2) = 24706; split (3*4096 + 2*1024 + 32 + 4*14336)/2
    #   = 71712/2 = 35856; sum 60562 -> 60562 * 2048 * 4 = 496123904 bytes a sequence.
    #   head: (2*4096 + 1) + 4096 + 128256/2 + 2 = 76419 -> * 8192 = 626024448
    #   embed: 2048 ids * 8 bytes = 16384
    # 1F1B, p = 4, m = 8, micro-batch 1: rank r holds 4 - r micro-batches at its peak.
    #   rank 0: 4 * (16384 + 8*496123904) = 4 * 3969007616 = 15876030464
    #   rank 1: 3 * 3968991232 = 11906973696;  rank 2: 2 * 3968991232 = 7937982464
    #   rank 3: 1 * (3968991232 + 626024448) = 4595015680
    # An input gradient sent back (one 2048 x 4096 fp32 message, 33554432 bytes) is held
    # until the previous rank sends an activation after receiving it: at its peak, its
    # last F, rank r >= 1 holds the one of its last B, which no later activation follows.
    static = [18162384896, 13959692288, 13959692288, 18162450432]
    message = 2048 * 4096 * 4
    acts = [15876030464, 11906973696 + message, 7937982464 + message, 4595015680 + message]
    code, out, _ = _plan(capsys, CASE + " --json")
    assert code == 0
    plan = json.loads(out)
    assert [s["params"] for s in plan["stages"]] == [1135149056, 872480768, 872480768, 1135153152]
    assert [r["static_bytes"] for r in plan["ranks"]] == static
    assert [r["peak_activation_bytes"] for r in plan["ranks"]] == acts
    assert [r["peak_bytes"] for r in plan["ranks"]] == [
        s + a for s, a in zip(static, acts, strict=True)
    ]
    # tp traffic per step, rank 1: 8 blocks * 4 all-reduces * 8 micro-batches
    #   * 2 (2-1)/2 * (2048 * 4096 * 4 = 32 MiB) = 8 GiB; rank 0 adds the embedding's one a
    #   micro-batch (8 * 32 MiB), rank 3 the head's.
    assert plan["tp_traffic_per_rank"] == [8.25 * 2**30, 8 * 2**30, 8 * 2**30, 8.25 * 2**30]
    # The printed table: 34038415360 B = 31.7 GiB, 18162384896 = 16.9 GiB, 15876030464 = 14.8.
    code, text, _ = _plan(capsys, CASE)
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == ["0"]]
    row = rows[1]  # the stage table's row 0, then the rank table's
    assert row[2:] == ["16.9", "GiB", "14.8", "GiB", "31.7", "GiB"]
    assert "tp 2; 4 x 2 = 8 processes" in text


# `pipetrain plan` of each preset at tp 1/2/4/8 (docs/tensor_parallel.md shows the rows):
# pp, --seq-len, --batch-size, --microbatches (1F1B, uniform split, micro-batch 1).
PRESETS = {"llama3-8b": (4, 2048, 8, 8), "llama3-70b": (8, 2048, 8, 8)}


def _formula(name: str, tp: int) -> dict[str, list[float]]:
    """Every per-stage and per-rank figure of the plan from docs/memory_model.md's
    formula, with the model's sizes read off its config (not the planner's code)."""
    c = get_model_config(name)
    pp, seq, batch, m = PRESETS[name]
    d, f, h, v, b = c.d_model, c.ffn_hidden, c.n_heads, c.vocab_size, batch // m
    hd = d // h
    kv = c.n_kv_heads * hd
    per_stage = c.n_layers // pp  # uniform: the embedding on rank 0, the head on the last
    block = 2 * d + (2 * d * d + 2 * d * kv + 3 * d * f) // tp
    block_act = hd + 2 * d + (4 * d + 2) + (3 * d + 2 * kv + h + 4 * f) // tp
    params, acts = [], []
    for r in range(pp):
        first, last = r == 0, r == pp - 1
        params.append(per_stage * block + first * (v * d // tp) + last * (d + v * d // tp))
        # Numbers kept a token: the embedding's int64 ids (2), the head's d + (2 d + 1)
        # + V / tp + 2.
        tokens = per_stage * block_act + first * 2 + last * (d + 2 * d + 1 + v // tp + 2)
        acts.append(4 * seq * tokens * b)  # a micro-batch of b sequences
    live = [min(pp - r, m) for r in range(pp)]
    static = [16 * p for p in params]  # fp32 weight, gradient, AdamW's two moments
    # 1F1B's peak is its last F, after m - (pp - r) backwards; each sent back its input
    # gradient, one (b, seq, d) fp32 message, held until the previous rank sends an
    # activation after receiving it, which every one but the last gets by then (none on
    # rank 0).
    sent = [(r > 0) * min(1, max(0, m - (pp - r))) * 4 * b * seq * d for r in range(pp)]
    peak_act = [n * a + g for n, a, g in zip(live, acts, sent, strict=True)]
    # tp collectives a step: 4 all-reduces a block, 1 for the embedding and the head, of
    # (b, seq, d) fp32 each, a ring moving 2 (tp - 1) / tp of it through every rank.
    ring = 2 * (tp - 1) / tp * 4 * b * seq * d * m
    counts = [4 * per_stage + (r == 0) + (r == pp - 1) for r in range(pp)]
    return {
        "params": params, "activation_bytes": acts, "live": live, "static": static,
        "peak_act": peak_act, "peak": [s + a for s, a in zip(static, peak_act, strict=True)],
        "traffic": [n * ring for n in counts],
    }  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(PRESETS))
def test_plan_per_rank_memory_matches_the_formula(
    capsys: pytest.CaptureFixture[str], name: str, tp: int
) -> None:
    pp, seq, batch, m = PRESETS[name]
    flags = f"--model {name} --pp {pp} --tp {tp} --seq-len {seq} --batch-size {batch} "
    flags += f"--microbatches {m}"
    want = _formula(name, tp)
    code, out, _ = _plan(capsys, flags + " --json")
    assert code == 0
    plan = json.loads(out)
    stages, ranks = plan["stages"], plan["ranks"]
    assert [s["params"] for s in stages] == want["params"]
    assert [s["activation_bytes"] for s in stages] == want["activation_bytes"]
    assert [s["live_microbatches"] for s in stages] == want["live"]
    assert [r["static_bytes"] for r in ranks] == want["static"]
    assert [r["peak_activation_bytes"] for r in ranks] == want["peak_act"]
    assert [r["peak_bytes"] for r in ranks] == want["peak"]
    assert plan["tp_traffic_per_rank"] == pytest.approx(want["traffic"], rel=1e-12)
    # The printed rank table: params+grads+adamw, peak activations and total in GiB.
    code, text, _ = _plan(capsys, flags)
    assert code == 0
    lines = text.split(" rank  compute/step s")[1].splitlines()[1 : pp + 1]
    for r, line in enumerate(lines):
        cells = line.split()
        figures = (want["static"][r], want["peak_act"][r], want["peak"][r])
        assert cells[0] == str(r) and cells[3::2] == ["GiB"] * 3, line
        assert cells[2::2] == [f"{x / 2**30:.1f}" for x in figures], line


def test_sequence_parallel_splits_the_norms_but_not_the_gathered_inputs() -> None:
    config = get_model_config("llama3-8b")
    d, t = config.d_model, 2048
    plain = estimate_costs(config, t, tp=4)[1].activation_bytes_per_sample
    sp = estimate_costs(config, t, tp=4, sequence_parallel=True)[1].activation_bytes_per_sample
    # The norms' input, normalised value and statistic, 4 d + 2 a token, go from whole to 1/4.
    assert plain - sp == pytest.approx((4 * d + 2) * (1 - 1 / 4) * t * 4)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "gpt2-tiny"])
@pytest.mark.parametrize("tp", [2, 4])
def test_blocks_divide_by_tp_but_for_the_norms(name: str, tp: int) -> None:
    config = get_model_config(name)
    embed1, block1, head1 = layer_params(config)
    embed, block, head = layer_params(config, tp)
    whole = 2 * config.d_model if config.family == "llama" else 6 * config.d_model
    assert block - whole == (block1 - whole) // tp
    if config.d_model >= 1024:  # at real sizes the norms are a rounding error
        assert block1 / block == pytest.approx(tp, rel=1e-3)
    assert head1 - head == config.vocab_size * config.d_model * (tp - 1) // tp
    if config.family == "llama":
        assert embed * tp == embed1


def test_llama3_70b_preset_has_70b_parameters() -> None:
    config = get_model_config("llama3-70b")
    embed, block, head = layer_params(config)
    assert (config.n_layers, config.n_heads, config.n_kv_heads) == (80, 64, 8)
    assert embed + config.n_layers * block + head == pytest.approx(70.55e9, rel=1e-3)


@pytest.mark.parametrize(
    "flags, field",
    [
        ("--model llama3-8b --pp 4 --tp 3", "n_heads = 32"),
        ("--model llama3-8b --pp 4 --tp 16", "n_kv_heads = 8"),
        ("--model llama-tiny --pp 2 --tp 4", "n_kv_heads = 2"),
        ("--model llama3-8b --pp 4 --tp 2 --set vocab_size=128257", "vocab_size = 128257"),
        ("--model llama3-8b --pp 4 --tp 2 --set ffn_hidden=14337", "ffn_hidden = 14337"),
    ],
)
def test_tp_not_dividing_the_model_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str], flags: str, field: str
) -> None:
    code, out, err = _plan(capsys, flags)
    assert code == 2 and not out
    assert err.count("\n") == 1 and field in err and "--tp" in err


@pytest.mark.parametrize(
    "flags, words",
    [
        ("--model gpt2-tiny --pp 2 --tp 2 --sequence-parallel", "learned positions"),
        ("--model llama3-8b --pp 4 --tp 2 --sequence-parallel --seq-len 1001", "multiple of 2"),
        ("--model llama3-8b --pp 4 --tp 2 --balance profile", "--balance uniform or params"),
        ("--model llama3-8b --pp 4 --sequence-parallel", "add --tp 2"),
        ("--model llama3-8b --pp 4 --tp 2 --tp-bandwidth 0", "--tp-bandwidth"),
        ("--model llama3-8b --pp 4 --tp 0", "--tp must be >= 1"),
    ],
)
def test_tp_flags_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], flags: str, words: str
) -> None:
    code, out, err = _plan(capsys, flags)
    assert code == 2 and not out
    assert err.count("\n") == 1 and words in err


def test_tp_bandwidth_puts_the_collectives_on_the_layers() -> None:
    config = get_model_config("llama3-8b")
    free = estimate_costs(config, 2048, tp=8)
    timed = estimate_costs(config, 2048, tp=8, tp_bandwidth=1e11)
    # A block: 2 all-reduces of 2048 * 4096 * 4 bytes forward, 2 backward, 2 * 7/8 each.
    one = 2 * 7 / 8 * 2048 * 4096 * 4 / 1e11
    assert timed[1].forward - free[1].forward == pytest.approx(2 * one)
    assert timed[1].backward_input - free[1].backward_input == pytest.approx(2 * one)
    assert timed[1].backward_weight == free[1].backward_weight
    assert timed[-1].forward == free[-1].forward  # the head's logits stay sharded


def test_tp_collective_counts_and_refusals() -> None:
    assert layer_collectives("block").total == 4
    assert layer_collectives("embedding", sequence_parallel=True).forward == 0.5
    assert tp_time(2, 100.0, 1, 1.0) == 0.0  # tp 1: nothing moves
    assert tp_time(1, 100.0, 4, None) == 0.0  # no bandwidth: bytes only
    assert tp_time(1, 100.0, 4, 10.0) == pytest.approx(15.0)  # 2 * 3/4 * 100 / 10
    with pytest.raises(TensorParallelError, match="--tp-bandwidth"):
        tp_time(1, 100.0, 4, -1.0)
    with pytest.raises(TensorParallelError, match="--tp"):
        tp_time(1, 100.0, 0, 1.0)
