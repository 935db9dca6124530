"""``pipetrain plan`` for mixture-of-experts models: Mixtral 8x7B's published size, its
per-rank parameters under --ep and its all-to-all bytes computed by hand, and the one-line
refusals of an --ep that does not fit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_errors import one_line_error

from pipetrain.cli import main

pytestmark = pytest.mark.e2e

MIXTRAL = "--model mixtral-8x7b --pp 4 --seq-len 4096 --batch-size 8 --microbatches 8"


def test_mixtral_plan_prints_its_size_and_the_all_to_alls_of_ep_8() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetrain.cli",
            "plan",
            *f"{MIXTRAL} --ep 8 --ep-bandwidth 5e10".split(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Published: 46.7 B parameters, 12.9 B active per token.
    assert "46.70 B parameters, 12.88 B active per token" in done.stdout
    assert "a rank holds 1 of the 8 experts of every MoE layer" in done.stdout
    # One all-to-all: 4096 tokens x top-2 x 4096 x 4 bytes x 7/8 = 117440512 B = 112 MiB;
    # 8 MoE layers a rank x 4 all-to-alls x 8 micro-batches: 28 GiB, 30064771072 B / 5e10 B/s.
    assert "each sending 112.0 MiB from every rank" in done.stdout
    assert "rank 1: 8 MoE layers, all-to-alls send 28.0 GiB per step, 0.601 s" in done.stdout


def test_ep_divides_the_experts_and_adds_the_all_to_all_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def plan(flags: str) -> dict[str, object]:
        assert main(["plan", *MIXTRAL.split(), "--json", *flags.split()]) == 0
        out: dict[str, object] = json.loads(capsys.readouterr().out)
        return out

    whole, ep8, timed = plan(""), plan("--ep 8"), plan("--ep 8 --ep-bandwidth 5e10")
    stages = [p["stages"][1] for p in (whole, ep8, timed)]  # type: ignore[index]
    # A block: norms 2 x 4096, attention 2 x 4096^2 + 2 x 4096 x 1024, router 4096 x 8,
    # experts 3 x 4096 x 14336 each: 8 of them whole, 1 per rank at ep 8.
    attention_and_router = 8192 + 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8
    expert = 3 * 4096 * 14336
    assert stages[0]["params"] == 8 * (attention_and_router + 8 * expert)
    assert stages[1]["params"] == 8 * (attention_and_router + expert)
    # 8 layers x 2 all-to-alls of 117440512 B at 5e10 B/s, forward and backward each.
    extra = 8 * 2 * 117440512 / 5e10
    assert stages[2]["forward"] == pytest.approx(stages[1]["forward"] + extra, rel=1e-9)
    assert stages[2]["backward"] == pytest.approx(stages[1]["backward"] + extra, rel=1e-9)
    moe = ep8["moe"]
    assert moe["params"] == 46_702_792_704 and moe["ep"] == 8  # type: ignore[index]
    assert moe["ep_traffic_per_rank"] == [8 * 4 * 8 * 117440512.0] * 4  # type: ignore[index]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("--model llama-tiny --ep 2", "--ep 2 shards experts, but model 'llama-tiny' is dense"),
        ("--model moe-default --ep 3", "which do not split over --ep 3 ranks"),
        ("--model moe-default --ep-bandwidth 1e9", "--ep-bandwidth is for expert parallelism"),
        ("--model moe-default --ep 2 --ep-bandwidth inf", "--ep-bandwidth is inf"),
    ],
)
def test_an_ep_that_does_not_fit_is_one_line_and_exit_2(
    flags: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in one_line_error(["plan", "--pp", "2", *flags.split()], capsys)


def test_a_moe_blocks_tp_collectives_are_attentions_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = "--model moe-tiny --pp 2 --tp 2 --seq-len 64 --batch-size 4 --microbatches 4 --json"
    assert main(["plan", *flags.split()]) == 0
    out = json.loads(capsys.readouterr().out)
    # Per micro-batch: the embedding's all-reduce (rank 0) or the head's (rank 1) and one
    # forward and one backward in each of 2 MoE blocks (attention's; the experts are whole
    # on every tp rank): 5 all-reduces of 64 x 32 x 4 bytes, each through a link 2 (2-1)/2
    # times, 4 micro-batches: 5 x 8192 x 4 = 163840 bytes, not the dense blocks' 2 + 2.
    assert out["tp_traffic_per_rank"] == [163840.0, 163840.0]
