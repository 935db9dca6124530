"""`pipetrain train --init-from DIR`: a tiny Llama saved by transformers fine-tunes through
a two-stage pipeline (one process) from its own weights: the first step's loss is
transformers' loss on the same batch, and the loss falls. A directory that cannot be
imported is one line and exit status 2 before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_records import read_records

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


def test_fine_tuning_starts_from_the_imported_weights(
    llama_dir: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, theirs = llama_dir
    settings = {**SETTINGS, "run.out_dir": str(tmp_path), "model.init_from": str(directory)}
    code = main(["train", *_flags(settings), "--name", "ft"])
    assert code == 0
    steps = [r for r in read_records(tmp_path / "ft" / "metrics.jsonl") if "loss" in r]
    config = load_config(overrides=settings)
    batch = train_batch(load_corpus(config.data), 0, seed=0, batch_size=4, seq_len=16)
    with torch.no_grad():
        logits = theirs(torch.as_tensor(batch.inputs)).logits
        ref = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 256), torch.as_tensor(batch.targets).reshape(-1)
        )
    assert steps[0]["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert steps[-1]["loss"] < steps[0]["loss"]


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
