"""`pipetrain train --init-from DIR`: a tiny Llama saved sharded by transformers
fine-tunes over pp=2 in two gloo processes (each reading its own layers) from its own
weights: the first step's loss is transformers' loss on the same batch, and the loss
falls. A tiny Qwen2 whose directory holds a tokenizer.json, fine-tuned through a
two-stage pipeline in one process, reads its text with it, its closing sample and
`generate` decode with it, and `ckpt export --format hf` writes it back beside weights
whose greedy continuation in transformers is pipetrain's. A tiny Mixtral
trains through the real launcher over pp=2 x dp=2 x ep=2 (4 processes, each reading its
own layers' own experts), and its checkpoint exported with --format hf loads back into
transformers. A directory that cannot be imported (an unsupported architecture, a missing
shard, shapes that disagree with config.json, a tokenizer larger than the embedding) is
one line and exit status 2 before any training."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_errors import one_line_error
from run_records import losses, train_run

from pipetrain.cli import main
from pipetrain.config import load_config
from pipetrain.data import load_corpus, train_batch

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
    step loss is the language-model loss alone), read with the run's own tokenizer."""
    config = load_config(overrides=settings)
    batch = train_batch(load_corpus(config.data), 0, seed=0, batch_size=4, seq_len=16)
    with torch.no_grad():
        logits = theirs(torch.as_tensor(batch.inputs)).logits
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), torch.as_tensor(batch.targets).reshape(-1)
            )
        )


def test_fine_tuning_over_two_processes_starts_from_the_imported_weights(
    llama_dir: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    directory, theirs = llama_dir
    assert len(list(directory.glob("model-*.safetensors"))) > 1  # sharded, with its index
    settings = {**SETTINGS, "pipeline.single_process": False, "model.init_from": str(directory)}
    train_run(tmp_path, "ft", *_flags(settings))  # --pp 2: two gloo processes
    got = losses(tmp_path / "ft")
    assert got[1] == pytest.approx(_their_first_loss(theirs, settings), rel=1e-5)
    assert got[4] < got[1]


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


def _word_tokenizer(data: Path) -> Any:
    """A word-level tokenizer.json trained on the corpus: its words, an unknown token and
    an end-of-text token (which the data puts between documents)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train([str(f) for f in sorted(data.iterdir())], trainer)
    return tokenizer


@pytest.fixture(scope="module")
def qwen2_dir(work: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Qwen2 (q/k/v biases) as wide as its own tokenizer.json."""
    directory = tmp_path_factory.mktemp("qwen2")
    tokenizer = _word_tokenizer(work / "data")
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.token_to_id("<|endoftext|>"),
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # logits far from uniform: a greedy sample of varied words
        model.lm_head.weight.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, tokenizer


def _greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = [*ids, int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids


def test_the_directorys_tokenizer_reads_the_data_samples_and_is_exported(
    work: Path,
    qwen2_dir: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    directory, tokenizer = qwen2_dir
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    settings = {
        **SETTINGS,
        "run.out_dir": str(tmp_path),
        "model.init_from": str(directory),
        "data.path": str(work / "data"),
        "run.sample_tokens": 8,
        "run.sample_temperature": 0.0,
    }
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(["train", *_flags(settings), "--name", "qwen2", *ckpt]) == 0
    got = losses(tmp_path / "qwen2")
    # The first batch as the directory's tokenizer reads it (bytes would not fit).
    assert got[1] == pytest.approx(_their_first_loss(theirs, settings), rel=1e-5)
    assert got[4] < got[1]
    sample = capsys.readouterr().out.split("sample (temperature 0.0):\n", 1)[1].splitlines()[0]
    assert main(["generate", "--checkpoint", ckpt[1], "--prompt", "def ", "--max-new-tokens",
                 "8", "--temperature", "0"]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines() == [sample]
    out = tmp_path / "hf"
    assert main(["ckpt", "export", ckpt[1], "--out", str(out), "--format", "hf"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reread = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    prompt = reread.encode("def ")
    assert prompt == tokenizer.encode("def ").ids
    # Words of the vocabulary, decoded from the ids transformers' greedy continuation of
    # the exported model gives too.
    assert "def " + reread.decode(_greedy(back, prompt, 8)[1:], skip_special_tokens=True) == sample
    assert len(set(sample.split())) > 2 and set(sample.split()) <= set(tokenizer.get_vocab())


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("drop a shard", r"index.json names the shard model-0000\d-of-0000\d.safetensors, which "),
        ("widen the MLP", r"mlp.\w+_proj.weight has shape \(\d+, \d+\) but config.json gives "),
        ("a larger tokenizer", r"tokenizer .*tokenizer.json has 300 tokens but .* has 256: use"),
    ],
    ids=["missing-shard", "shapes-disagree", "tokenizer-too-large"],
)
def test_a_directory_that_does_not_fit_is_one_line_before_training(
    llama_dir: tuple[Path, torch.nn.Module],
    damage: str,
    said: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tokenizers import Tokenizer, models

    directory = shutil.copytree(llama_dir[0], tmp_path / "model")
    if damage == "drop a shard":
        sorted(directory.glob("model-*.safetensors"))[-1].unlink()
    elif damage == "widen the MLP":
        raw = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(raw | {"intermediate_size": 64}))
    else:
        words = {f"w{i}": i for i in range(300)}
        Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(directory / "tokenizer.json"))
    settings = {**SETTINGS, "run.out_dir": str(tmp_path), "model.init_from": str(directory)}
    line = one_line_error(["train", *_flags(settings)], capsys)
    assert re.search(f"model.init_from: .*{said}", line), line
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no run folder
