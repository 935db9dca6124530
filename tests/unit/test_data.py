"""Data: the default corpus, user corpora, the held-out split and seeded batches."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetrain.config.schema import ConfigError, DataConfig
from pipetrain.data import (
    ByteTokenizer,
    Corpus,
    DataError,
    eval_batches,
    load_corpus,
    load_tokenizer,
    train_batch,
)


@pytest.fixture(scope="module")
def stdlib_corpus() -> Corpus:
    return load_corpus(DataConfig(max_bytes=200_000, eval_fraction=0.1))


def test_default_corpus_is_the_standard_library(stdlib_corpus: Corpus) -> None:
    assert "standard library" in stdlib_corpus.description
    assert stdlib_corpus.vocab_size == 256
    assert stdlib_corpus.train.dtype == np.uint8
    assert 200_000 <= len(stdlib_corpus.train) < 400_000
    assert len(stdlib_corpus.eval) > 10_000
    text = stdlib_corpus.tokenizer.decode(stdlib_corpus.train[:50_000].tolist())
    assert "def " in text and "import " in text


def test_default_corpus_is_the_same_every_time(stdlib_corpus: Corpus) -> None:
    again = load_corpus(DataConfig(max_bytes=200_000, eval_fraction=0.1))
    assert np.array_equal(again.train, stdlib_corpus.train)
    assert np.array_equal(again.eval, stdlib_corpus.eval)


def test_held_out_part_is_fixed_by_name_not_by_budget(stdlib_corpus: Corpus) -> None:
    # Reading more text adds documents but keeps the held-out ones held out: the eval
    # stream of the small read is a prefix of the larger one's.
    bigger = load_corpus(DataConfig(max_bytes=400_000, eval_fraction=0.1))
    assert np.array_equal(bigger.eval[: len(stdlib_corpus.eval)], stdlib_corpus.eval)
    assert np.array_equal(bigger.train[: len(stdlib_corpus.train)], stdlib_corpus.train)


def test_batches_are_a_function_of_seed_and_step(stdlib_corpus: Corpus) -> None:
    a = train_batch(stdlib_corpus, 3, seed=1, batch_size=4, seq_len=32)
    b = train_batch(stdlib_corpus, 3, seed=1, batch_size=4, seq_len=32)
    c = train_batch(stdlib_corpus, 4, seed=1, batch_size=4, seq_len=32)
    d = train_batch(stdlib_corpus, 3, seed=2, batch_size=4, seq_len=32)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)
    assert not torch.equal(a.inputs, d.inputs)
    assert a.inputs.shape == (4, 32) and a.inputs.dtype == torch.int64
    assert a.tokens == 128
    # Targets are the inputs shifted by one token.
    assert torch.equal(a.inputs[:, 1:], a.targets[:, :-1])


def test_eval_batches_are_fixed_and_from_the_held_out_stream(stdlib_corpus: Corpus) -> None:
    first = eval_batches(stdlib_corpus, batch_size=4, seq_len=16, count=3)
    second = eval_batches(stdlib_corpus, batch_size=4, seq_len=16, count=3)
    assert len(first) == 3
    for x, y in zip(first, second, strict=True):
        assert torch.equal(x.inputs, y.inputs)
    window = first[1].inputs[0].numpy().astype(np.uint8).tobytes()
    assert window in stdlib_corpus.eval.tobytes()


def test_text_file_holds_out_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i}\n" for i in range(2000)))
    corpus = load_corpus(DataConfig(path=str(path), seq_len=16, eval_fraction=0.1))
    assert ByteTokenizer().decode(corpus.eval.tolist()).endswith("line 1999\n")
    assert len(corpus.eval) == pytest.approx(0.1 * (len(corpus.train) + len(corpus.eval)), abs=2)
    assert "line 0\n" in ByteTokenizer().decode(corpus.train.tolist())


def test_folder_of_text_files_skips_binary(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * 40)
    (tmp_path / "blob.bin").write_bytes(bytes([0xFF, 0xFE, 0x80]) * 100)
    corpus = load_corpus(DataConfig(path=str(tmp_path), seq_len=16))
    text = ByteTokenizer().decode(corpus.train.tolist() + corpus.eval.tolist())
    assert "document 29" in text and "\ufffd" not in text
    assert "30 documents" in corpus.description


def test_jsonl_text_field(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        "\n".join(json.dumps({"text": f"record {i} " * 10, "id": i}) for i in range(50)) + "\n\n"
    )
    corpus = load_corpus(DataConfig(path=str(path), seq_len=8))
    assert "record 7 " in ByteTokenizer().decode(corpus.train.tolist() + corpus.eval.tolist())


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("not json", ("line 2 is not JSON",)),
        ('{"body": "x"}', ("line 2", 'no string "text" field')),
    ],
)
def test_bad_jsonl_line_is_named(tmp_path: Path, line: str, words: tuple[str, ...]) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(path=str(path), seq_len=2))
    for word in words:
        assert word in str(info.value)


def test_too_little_text_says_what_to_change(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"too few for sequences of data.seq_len 128.*--seq-len"):
        load_corpus(DataConfig(path=str(path)))


def test_empty_folder_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds no text"):
        load_corpus(DataConfig(path=str(tmp_path)))


def test_data_error_is_a_config_error() -> None:
    assert issubclass(DataError, ConfigError)


@pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed"
)
def test_tokenizer_without_the_package_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(DataError, match=r"needs the 'tokenizers' package.*pip install tokenizers"):
        load_tokenizer(str(path))


def test_byte_tokenizer_round_trips() -> None:
    tokenizer = load_tokenizer("")
    assert tokenizer.vocab_size == 256
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"


def test_a_large_document_does_not_swell_the_held_out_part() -> None:
    # The first held-out document of the standard library within 100 kB is far larger than
    # 5% of it: it is cut at the budget, as the train document that crosses max_bytes is.
    corpus = load_corpus(DataConfig(max_bytes=100_000, eval_fraction=0.05))
    assert 100_000 <= len(corpus.train) < 110_000
    assert 5_000 <= len(corpus.eval) < 5_500


@pytest.mark.parametrize("max_bytes", [8_000_000, 200_000])
def test_a_few_files_are_not_mostly_held_out_nor_dropped(tmp_path: Path, max_bytes: int) -> None:
    # n1.txt and n2.txt both fall below the 5% hash threshold: the split by name held out
    # 2 of the 3 files (67% of the text), and with a small held-out budget it kept a cut
    # of n1 and dropped n2 altogether ("2 documents").
    texts = {f"n{i}.txt": "".join(f"file {i} line {j}\n" for j in range(1500)) for i in (1, 2, 3)}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    corpus = load_corpus(DataConfig(path=str(tmp_path), max_bytes=max_bytes, eval_fraction=0.05))
    assert "3 documents" in corpus.description
    total = len(corpus.train) + len(corpus.eval)
    assert len(corpus.eval) <= 0.1 * total
    everything = ByteTokenizer().decode(corpus.train.tolist() + corpus.eval.tolist())
    for i in (1, 2, 3):
        assert f"file {i} line 0\n" in everything and f"file {i} line 1499\n" in everything


def _word_tokenizer(folder: Path, eos_config: str | None) -> Path:
    """A word-level tokenizer.json with an end-of-text token, and optionally the
    tokenizer_config.json that names it, as a Hugging Face model directory holds them."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "<eot>": 2, "alpha": 3, "beta": 4, "gamma": 5}
    tokenizer = HFTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>", "<eot>"])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    if eos_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_config}))
    return folder / "tokenizer.json"


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
@pytest.mark.parametrize(("eos_config", "eod"), [(None, 1), ("<eot>", 2)])
def test_documents_are_packed_with_the_end_of_text_token(
    tmp_path: Path, eos_config: str | None, eod: int
) -> None:
    path = _word_tokenizer(tmp_path / "tok", eos_config)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["alpha beta", "gamma"] * 40))
    config = DataConfig(path=str(data), tokenizer=str(path), seq_len=4, max_bytes=10_000)
    corpus = load_corpus(config)
    stream = corpus.train.tolist()
    # Documents "alpha beta" and "gamma" (3 4 and 5), each ended by the end-of-text token.
    assert set(stream) == {3, 4, 5, eod}  # no blank line or unknown token between them
    ends = [i for i, t in enumerate(stream[:-1]) if t in (4, 5)]
    assert ends and all(stream[i + 1] == eod for i in ends)
    assert all(stream[i + 1] in (3, 5) for i, t in enumerate(stream[:-1]) if t == eod)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="needs tokenizers")
@pytest.mark.parametrize(("eos_token_id", "eod"), [(2, 2), (50_000, 1), (-1, 1)])
def test_a_config_eos_id_the_tokenizer_lacks_is_not_put_into_the_data(
    tmp_path: Path, eos_token_id: int, eod: int
) -> None:
    # config.json of another tokenizer (id 50000 of a 6-word vocabulary) named an id that no
    # embedding row of this tokenizer's model holds: the usual name (<|endoftext|>) is used.
    path = _word_tokenizer(tmp_path / "tok", None)
    (path.parent / "config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    assert load_tokenizer(str(path)).eod_id == eod
