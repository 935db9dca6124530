"""``pipetrain plan`` end to end: tables, --json fields, a measured plan, one-line errors.

Odd inputs a user met: non-finite costs, --chunks without a multi-stage schedule and a
--split that starts with a dash are one line and exit status 2 (in this process), the
--memory-limit its error suggests is taken, and --balance profile refuses a device that
cannot time layers or a size beyond the machine, and takes the fixed part out of a
measurement at one sample (as real processes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_errors import one_line_error as _one_line_error

from pipetrain.cli import main

pytestmark = pytest.mark.e2e


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_json_plan_of_the_main_job() -> None:
    done = _plan("--model", "llama-default", "--pp", "3", "--memory-limit", "1GiB", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    stages = out["stages"]
    assert [s["rank"] for s in stages] == [0, 1, 2]
    assert [s["blocks"] for s in stages] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [(s["embedding"], s["head"]) for s in stages] == [
        (True, False),
        (False, False),
        (False, True),
    ]
    assert all(s["params"] > 0 and s["time"] > 0 and s["activation_bytes"] > 0 for s in stages)
    times = [s["time"] for s in stages]
    assert out["imbalance"] == pytest.approx(max(times) / (sum(times) / 3))
    assert out["time_source"].startswith("estimated from FLOPs")
    assert out["max_microbatch_size"] >= out["microbatch_size"]
    assert out["recommended"]["microbatches"] in [
        o["microbatches"] for o in out["options"] if o["fits"]
    ]


def test_table_plan_with_an_explicit_split_on_a_v_schedule() -> None:
    done = _plan(
        "--model", "llama-default", "--pp", "3", "--schedule", "zb-v", "--split", "2,2,2,2,2,2"
    )
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "estimated from FLOPs" in text and "explicit split" in text
    assert "embed .. layers.1" in text and "layers.10 .. head" in text
    assert "imbalance (slowest stage / mean)" in text and "recommended: --microbatches" in text
    assert text.endswith("to train this split: pipetrain train ... --split 2,2,2,2,2,2\n")


def test_params_balance_on_a_real_size() -> None:
    done = _plan(
        "--model", "llama3-8b", "--pp", "4", "--balance", "params", "--seq-len", "4096",
        "--batch-size", "16", "--microbatches", "16", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    params = [s["params"] for s in out["stages"]]
    assert sum(params) == pytest.approx(8.03e9, rel=0.01)
    assert max(params) / min(params) < 1.2
    # The split to pass to `pipetrain train --split`: blocks per stage, all 32 of them.
    blocks = [int(n) for n in out["train_split"].split(",")]
    assert len(blocks) == 4 and sum(blocks) == 32 and blocks[0] < blocks[1]


def test_measured_plan_of_a_tiny_model() -> None:
    done = _plan(
        "--model", "llama-tiny", "--pp", "2", "--balance", "profile", "--batch-size", "4",
        "--microbatches", "2", "--seq-len", "16", "--repeats", "1", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["time_source"].startswith("measured on cpu")
    assert out["method"] == "profile"
    assert sorted(b for s in out["stages"] for b in s["blocks"]) == [0, 1, 2, 3]
    assert all(s["time"] > 0 for s in out["stages"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--split", "4,3,4"], "adds up to 11 blocks but the model has 12"),
        (["--split", "4,three,5"], "not a list of whole numbers"),
        (["--split", "6,0,6"], "no layer"),
        (["--split", "4,4,4", "--balance", "params"], "not allowed with argument"),
        (
            ["--balance", "params", "--pp", "16", "--microbatches", "16"],
            "16 stages but only 14 layers",
        ),
        (["--pp", "16", "--microbatches", "16"], "leaves stages empty"),
        (["--memory-limit", "1MiB"], "memory limit"),
        (
            ["--memory-limit", "1MiB", "--balance", "params"],
            "no split into 3 stages fits the memory limit",
        ),
        (["--memory-limit", "lots"], "is not a size"),
        (["--microbatches", "2"], "1f1b needs --microbatches >= --pp"),
        (["--batch-size", "30"], "not a whole number of --microbatches"),
        (["--seq-len", "4096"], "max_seq_len"),
        (["--balance", "profile", "--device", "tpu9"], "is not a device"),
    ],
)
def test_bad_plans_get_one_line_and_exit_2(args: list[str], message: str) -> None:
    base = ["--model", "llama-default", "--pp", "3"]
    done = _plan(*base, *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(torch_has_cuda(), reason="checks the message on a machine without CUDA")
def test_profile_on_a_missing_gpu_says_so() -> None:
    done = _plan("--model", "llama-tiny", "--pp", "2", "--balance", "profile", "--device", "cuda")
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_preset_fields_can_be_changed() -> None:
    done = _plan(
        "--model",
        "llama-tiny",
        "--set",
        "n_layers=7",
        "--set",
        "tie_embeddings=true",
        "--pp",
        "3",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert sorted(b for s in out["stages"] for b in s["blocks"]) == list(range(7))
    done = _plan("--model", "llama-tiny", "--set", "n_heads=3", "--pp", "2")
    assert done.returncode == 2 and "d_model=32 is not divisible by n_heads=3" in done.stderr


def test_unknown_model_lists_the_presets() -> None:
    done = _plan("--model", "llama-huge", "--pp", "2")
    assert done.returncode == 2
    assert "llama-default" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_split_with_the_embedding_or_the_head_alone_is_offered_and_trains(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 5 stages of a 4-block model: the head alone on the last stage. The trainer refused
    # more stages than blocks although a split may leave an end stage without blocks.
    from pipetrain.cli import main
    from pipetrain.config import load_config
    from pipetrain.train.plan import plan_run

    args = ["plan", "--model", "llama-tiny", "--pp", "5", "--schedule", "gpipe"]
    assert main([*args, "--balance", "params"]) == 0
    text = capsys.readouterr().out
    assert text.endswith("to train this split: pipetrain train ... --split 1,1,1,1,0\n")
    assert main([*args, "--balance", "params", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["train_split"] == "1,1,1,1,0"
    for setting in ({"pipeline.split": "1,1,1,1,0"}, {"pipeline.balance": "params"}):
        overrides = {"run.name": "t", "model.name": "llama-tiny", "data.seq_len": 16}
        config = load_config(overrides={**overrides, "pipeline.pp": 5, **setting})
        plan = plan_run(config, vocab_size=256)
        assert [len(layers) for layers in plan.split] == [2, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--flops", "nan"], "--flops is nan: give a finite number > 0"),
        (["--flops", "inf"], "--flops is inf"),
        (["--overhead-ms", "nan"], "--overhead-ms is nan"),
        (["--latency-ms", "inf"], "--latency-ms is inf"),
        (["--chunks", "2"], "--chunks 2 needs a schedule with several stages per rank"),
    ],
)
def test_plan_refuses_what_it_used_to_plan_as_nan_or_ignore(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _one_line_error(["plan", "--model", "llama-tiny", "--pp", "2", *flags], capsys)
    assert words in line


def test_plan_takes_the_memory_limit_its_error_suggests(capsys: pytest.CaptureFixture[str]) -> None:
    # "--memory-limit 2e9" was refused with "write e.g. 16GiB, 512MiB or 2e9".
    argv = ["plan", "--model", "llama-tiny", "--pp", "2", "--memory-limit", "2e9", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["memory_limit"] == 2e9
    line = _one_line_error([*argv[:-2], "1e400", "--json"], capsys)
    assert "--memory-limit '1e400' is not a size" in line


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_split_that_starts_with_a_dash_gets_its_own_error(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse took "-1,3,2" for an option and said "expected one argument".
    argv = [command, "--model", "llama-tiny", "--pp", "3", "--split", "-1,3,2"]
    if command == "train":
        argv += ["--steps", "20", "--seq-len", "16", "--set", f"run.out_dir={tmp_path}"]
    assert "--split '-1,3,2' has a negative count" in _one_line_error(argv, capsys)


def test_an_option_with_its_value_missing_is_still_said_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--model", "llama-tiny", "--split", "--pp", "3"])
    assert stopped.value.code == 2
    assert "argument --split: expected one argument" in capsys.readouterr().err


def _gpt2_plan(*args: str) -> subprocess.CompletedProcess[str]:
    """``pipetrain plan --model gpt2-tiny --pp 2 *args`` as a real process."""
    return subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", "--model", "gpt2-tiny", "--pp", "2", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line(done: subprocess.CompletedProcess[str], message: str) -> None:
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks a machine without MPS")
def test_profile_devices_that_cannot_time_layers_are_refused() -> None:
    # --device meta "measured" every layer on tensors without data and printed a plan of
    # noise; a device torch was not built for (mps on Linux) ended in a traceback.
    _one_line(
        _gpt2_plan("--balance", "profile", "--device", "meta"), "--device meta runs no kernels"
    )
    _one_line(_gpt2_plan("--balance", "profile", "--device", "mps"), "--device mps cannot be used")


def test_a_profile_larger_than_the_machine_is_refused_before_it_starts() -> None:
    # A real size (llama3-8b at 8192 tokens) went on to materialise and time its layers
    # until the kernel killed the process for memory. This one needs terabytes anywhere.
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain.cli", "plan", "--model", "llama3-8b", "--pp", "2",
         "--balance", "profile", "--set", "vocab_size=100000000"],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    _one_line(done, "to measure layer head at micro-batch 4 x 8192, more than the")


def test_a_model_name_override_renames_the_plan() -> None:
    # --set name=... is a listed field of the preset; it crashed with a TypeError.
    done = _gpt2_plan("--set", "name=my-gpt")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("my-gpt: 1f1b on 2 ranks")


def test_a_profile_at_one_sample_takes_the_assumed_fixed_part_out_of_the_measurement() -> None:
    # At micro-batch 1 the fixed part per layer and action cannot be fitted; it was assumed
    # (--overhead-ms) and added to times that already contained it. With 1 s assumed, every
    # measured figure (well under 1 s) is all fixed part: a stage's forward is 1 s per layer.
    done = _gpt2_plan(
        "--balance", "profile", "--batch-size", "2", "--microbatches", "2", "--repeats", "1",
        "--overhead-ms", "1000", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "fixed part assumed 1000.0 ms" in out["time_source"]
    for stage in out["stages"]:
        assert stage["forward"] == pytest.approx(len(stage["layers"]))
        assert stage["backward"] == pytest.approx(2 * len(stage["layers"]))
