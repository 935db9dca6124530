"""`pipetrain train --init-from DIR`: a tiny Llama saved by transformers fine-tunes through
a two-stage pipeline (one process) from its own weights: the first step's loss is
transformers' loss on the same batch, and the loss falls. A tiny Mixtral does the same
through the real launcher over pp=2 x dp=2 x ep=2 (4 processes, each reading its own
layers' own experts), and its checkpoint exported with --format hf loads back into
transformers. A directory that cannot be imported is one line and exit status 2 before
any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_records import losses, read_records, train_run

from pipetrain.cli import main
from pipetrain.config import load_config
from pipetrain.train.data import load_corpus, train_batch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

SETTINGS = {
    "pipeline.pp": 2,
    "pipeline.single_process": True,
    "pipeline.microbatches": 2,
    "pipeline.threads": 1,
    "data.batch_size": 4,
    "data.seq_len": 16,
    "data.max_bytes": 50_000,
    "data.eval_batches": 1,
    "optim.warmup_steps": 0,
    "optim.lr": 3e-3,
    "run.steps": 4,
    "run.sample_tokens": 0,
}


def _flags(settings: dict[str, object]) -> list[str]:
    return [a for k, v in settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,  # the byte tokenizer's: no tokenizer.json in the directory
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="30KB")
    return directory, model


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=None,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="30KB")
    return directory, model


def _their_first_loss(theirs: torch.nn.Module, settings: dict[str, object]) -> float:
    """transformers' cross-entropy on the run's first batch (no auxiliary loss: pipetrain's
    step loss is the language-model loss alone)."""
    config = load_config(overrides=settings)
    batch = train_batch(load_corpus(config.data), 0, seed=0, batch_size=4, seq_len=16)
    with torch.no_grad():
        logits = theirs(torch.as_tensor(batch.inputs)).logits
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, 256), torch.as_tensor(batch.targets).reshape(-1)
            )
        )


def test_fine_tuning_starts_from_the_imported_weights(
    llama_dir: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, theirs = llama_dir
    settings = {**SETTINGS, "run.out_dir": str(tmp_path), "model.init_from": str(directory)}
    code = main(["train", *_flags(settings), "--name", "ft"])
    assert code == 0
    steps = [r for r in read_records(tmp_path / "ft" / "metrics.jsonl") if "loss" in r]
    assert steps[0]["loss"] == pytest.approx(_their_first_loss(theirs, settings), rel=1e-5)
    assert steps[-1]["loss"] < steps[0]["loss"]


def test_a_mixtral_over_expert_parallel_ranks_trains_and_exports_back(
    mixtral_dir: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, theirs = mixtral_dir
    settings = {**SETTINGS, "pipeline.single_process": False, "model.init_from": str(directory)}
    layout = ["--pp", "2", "--dp", "2", "--ep", "2"]  # micro-batches of 1 sequence
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    train_run(tmp_path, "ep2", *_flags(settings), *layout, *ckpt)
    got = losses(tmp_path / "ep2")
    assert got[1] == pytest.approx(_their_first_loss(theirs, settings), rel=1e-5)
    assert got[4] < got[1]
    out = tmp_path / "hf"
    assert (
        main(["ckpt", "export", str(tmp_path / "ckpt"), "--out", str(out), "--format", "hf"]) == 0
    )
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(back).__name__ == "MixtralForCausalLM"


def test_a_directory_that_cannot_be_imported_is_one_line(
    llama_dir: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"architectures": ["BertModel"]}')
    settings = {**SETTINGS, "run.out_dir": str(tmp_path), "model.init_from": str(tmp_path / "bert")}
    assert main(["train", *_flags(settings)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not supported: use a model of LlamaForCausalLM" in err and "\n" not in err


def test_an_asynchronous_schedule_refuses_imported_weights(
    llama_dir: tuple[Path, torch.nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = llama_dir
    settings = {**SETTINGS, "run.out_dir": str(tmp_path), "model.init_from": str(directory)}
    assert main(["train", *_flags(settings), "--schedule", "pipedream"]) == 2
    assert "model.init_from: the asynchronous trainer" in capsys.readouterr().err
