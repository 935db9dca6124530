"""`pipetrain generate` on odd input: a prompt whose bytes are not UTF-8 (taken as bytes by
byte tokens, refused in one line by a tokenizer.json) and more new tokens than the model's
context (said in one line before generating)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_errors import one_line_error

from pipetrain.checkpoint import Layout, save_checkpoint
from pipetrain.checkpoint.generate import generate_tokens, load_pipeline_model
from pipetrain.cli import main
from pipetrain.models import build_stage, get_model_config, model_spec

pytestmark = pytest.mark.e2e

# Bytes that are no UTF-8 (0xff never is), then text.
PROMPT = b"\xff\xfedef "


def _save(root: Path, data: dict[str, object]) -> Path:
    config = get_model_config("llama-tiny")
    stage = build_stage(model_spec(config), range(6), seed=2, device="cpu")
    fields = dataclasses.asdict(config)
    fields.pop("name")
    save_checkpoint(root, 1, modules=stage, model=fields, layout=Layout(), config={"data": data})
    return root / "step_000001"


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-tiny (64 positions) trained on sequences of 32 byte tokens."""
    return _save(tmp_path_factory.mktemp("bytes"), {"seq_len": 32, "tokenizer": ""})


def test_a_prompt_that_is_not_utf8_is_taken_as_bytes(byte_checkpoint: Path) -> None:
    command = [
        sys.executable, "-m", "pipetrain.cli", "generate", "--checkpoint", str(byte_checkpoint),
        "--prompt", PROMPT, "--max-new-tokens", "6", "--temperature", "0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    assert done.stderr == b""
    model = load_pipeline_model(byte_checkpoint, pp=1, device=torch.device("cpu"))
    expected = generate_tokens(
        model, list(PROMPT), new_tokens=6, temperature=0, seed=0, device=torch.device("cpu")
    )
    new_text = bytes(expected.tokens).decode("utf-8", errors="replace")
    # The prompt comes back as the bytes it was, the new tokens as the text they make.
    assert done.stdout == PROMPT + new_text.encode() + b"\n"


def test_a_prompt_that_is_not_utf8_is_refused_by_a_tokenizer_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenizers import Tokenizer, models

    vocab = {chr(c): c - 32 for c in range(32, 127)} | {"[UNK]": 95}
    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tokenizer))
    checkpoint = _save(tmp_path / "ckpt", {"seq_len": 32, "tokenizer": str(tokenizer)})
    argv = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "2"]
    line = one_line_error([*argv, "--prompt", PROMPT.decode("utf-8", "surrogateescape")], capsys)
    assert line == (
        "pipetrain generate: error: --prompt holds bytes that are not UTF-8, and the "
        "checkpoint's tokenizer.json reads only text: give the prompt as UTF-8 text"
    )


def test_more_new_tokens_than_the_context_is_said_in_one_line(
    byte_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--checkpoint", str(byte_checkpoint), "--prompt", "def "]
    assert main([*argv, "--max-new-tokens", "28", "--temperature", "0"]) == 0
    assert capsys.readouterr().err == ""  # 4 + 28 tokens: within the 32 of the context
    assert main([*argv, "--max-new-tokens", "40", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "pipetrain generate: note: 4 prompt and 40 new tokens are more than the model's "
        "context of 32: each token past it sees only the 32 before it (a sliding window), "
        "one forward pass per new token, and the text is printed at the end; lower "
        "--max-new-tokens for less"
    ]
    assert len(out.encode()) >= len("def ") + 40
