"""`pipetrain train --model moe-tiny --ep 2`: pp=2 x dp=2 x ep=2 through the real launcher
(4 processes) equals one process on the full batch (main and auxiliary losses), reports
expert loads and the most imbalanced layer, and its checkpoint resumes at ep=1 and under
other pipelines with the same next losses; `ckpt export` holds every expert by global
name; `generate` runs from it; bad expert settings (an imported Mixtral's top_k over its
experts too) are one line, exit 2.

Five launches: the one-process reference, pp2 x dp2 x ep2 (saving at step 2) and three
resumes from its step 2 (pp=2 x dp=2 at ep=1, pp=1 and pp=4 in one process each).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from run_records import assert_same_steps as _assert_same
from run_records import losses as _losses
from run_records import read_records, train_run

from pipetrain.cli import main

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "moe-tiny", "--steps", "4", "--batch-size", "8", "--seq-len", "16",
    "--eval-every", "0", "--set", "data.max_bytes=100000", "--set", "optim.warmup_steps=1",
    "--set", "run.sample_tokens=0", "--set", "data.eval_batches=1",
]  # fmt: skip
# Micro-batches of 2 sequences everywhere: the auxiliary loss is a per-micro-batch mean.
MB4 = ["--microbatches", "4"]
MB2 = ["--microbatches", "2"]


def _aux(run: Path) -> dict[int, float]:
    return {r["step"]: r["aux_loss"] for r in read_records(run) if "aux_loss" in r}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def reference(out: Path) -> Path:
    """One process, one stage, every expert, the full batch."""
    code = main(["train", *TINY, *MB4, "--pp", "1", "--name", "ref",
                 "--set", f"run.out_dir={json.dumps(str(out))}"])  # fmt: skip
    assert code == 0
    return out / "ref"


@pytest.fixture(scope="module")
def ep2(out: Path) -> subprocess.CompletedProcess[str]:
    flags = ["--pp", "2", "--dp", "2", "--ep", "2", "--checkpoint-dir", str(out / "ckpt_ep2")]
    return train_run(out, "ep2", *TINY, *MB2, *flags, "--checkpoint-every", "2")


def test_pp2_dp2_ep2_equals_one_process(
    out: Path, reference: Path, ep2: subprocess.CompletedProcess[str]
) -> None:
    _assert_same(_losses(out / "ep2"), _losses(reference), [1, 2, 3, 4], "loss")
    _assert_same(_aux(out / "ep2"), _aux(reference), [1, 2, 3, 4], "aux loss")
    step = next(r for r in read_records(out / "ep2") if r.get("step") == 1 and "loss" in r)
    # 8 x 16 tokens, 2 experts each, over the 4 experts of each of the 4 MoE layers.
    assert sorted(step["expert_load"]) == [f"layers.{i}.moe" for i in range(4)]
    assert all(sum(load) == 8 * 16 * 2 for load in step["expert_load"].values())
    assert all(v >= 1.0 for v in step["expert_imbalance"].values())
    assert step["dropped_tokens"] == 0
    assert "experts: most imbalanced layer layers." in ep2.stdout, ep2.stdout[-2000:]


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("ep1", ["--pp", "2", "--dp", "2", *MB2]),
        ("pp1", ["--pp", "1", *MB4]),
        ("pp4", ["--pp", "4", "--single-process", *MB4]),
    ],
)
def test_an_ep_checkpoint_resumes_under_another_layout(
    out: Path, reference: Path, ep2: subprocess.CompletedProcess[str], name: str, layout: list[str]
) -> None:
    ckpt = out / f"ckpt_{name}"
    ckpt.mkdir()
    shutil.copytree(out / "ckpt_ep2" / "step_000002", ckpt / "step_000002")
    result = train_run(out, name, *TINY, *layout, "--checkpoint-dir", str(ckpt), "--resume")
    assert "at step 2" in result.stdout, result.stdout[-2000:]
    _assert_same(_losses(out / name), _losses(reference), [3, 4], f"{name} from ep=2")
    _assert_same(_aux(out / name), _aux(reference), [3, 4], f"{name} aux from ep=2")


def test_export_and_generate_hold_every_expert(
    out: Path, ep2: subprocess.CompletedProcess[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from pipetrain.checkpoint.safetensors_io import read_safetensors

    step = out / "ckpt_ep2" / "step_000004"
    target = out / "export.safetensors"
    assert main(["ckpt", "export", str(step), "--out", str(target)]) == 0
    weights, _ = read_safetensors(target)
    for layer in range(4):
        for expert in range(4):
            assert tuple(weights[f"layers.{layer}.moe.experts.{expert}.w1.weight"].shape) == (
                32,
                32,
            )
    capsys.readouterr()
    args = [
        "--checkpoint",
        str(step),
        "--prompt",
        "def f",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    ]
    texts = []
    for pp in ("1", "2"):
        assert main(["generate", *args, "--pp", pp]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("def f")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--dp", "3", "--ep", "3", "--batch-size", "12"], "has 4 experts per MoE layer, which do not split over --ep 3"),
        (["--dp", "2", "--ep", "4"], "--ep 4 does not divide --dp 2"),
        (["--dp", "2", "--ep", "2", "--model", "llama-tiny"], "--ep 2 shards experts, but model 'llama-tiny' is dense"),
        (["--dp", "2", "--ep", "2", "--shard"], "--ep with --shard is not supported yet"),
        (["--model", "llama-tiny", "--capacity-factor", "1.0"], "model.capacity_factor drops tokens"),
        (["--capacity-factor", "-1"], "model.capacity_factor is -1.0"),
        (["--schedule", "pipedream"], "the asynchronous trainer does not train mixture-of-experts"),
    ],
)  # fmt: skip
def test_bad_expert_settings_are_one_line_and_exit_2(
    out: Path, flags: list[str], line: str
) -> None:
    assert line in _the_one_error_line(out, flags)


def test_an_imported_mixtral_with_more_experts_a_token_than_it_has_is_one_line(
    out: Path,
) -> None:
    """top_k > n_experts from the command line: the MoE fields come from a preset or from
    an imported model's config.json (num_experts_per_tok, num_local_experts)."""
    directory = out / "mixtral-top5"
    directory.mkdir()
    fields = {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": None,
        "num_local_experts": 4, "num_experts_per_tok": 5,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(fields))
    line = _the_one_error_line(out, ["--init-from", str(directory)])
    assert "top_k=5 is more than n_experts=4" in line and "lower top_k" in line, line


def _the_one_error_line(out: Path, flags: list[str]) -> str:
    """The train command's stderr, which must be one line, with exit status 2."""
    command = [
        sys.executable, "-m", "pipetrain.cli", "train", *TINY, *MB2, *flags,
        "--set", f"run.out_dir={json.dumps(str(out / 'bad'))}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [e for e in result.stderr.splitlines() if e.strip()]
    assert len(errors) == 1, errors
    return errors[0]
