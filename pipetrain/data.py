"""Training data: a corpus of tokens, a fixed held-out part, batches in a seeded order.

The default corpus is the Python standard library's source on this machine: its ``.py``
files (site-packages excluded), visited in the order of a fixed hash of their relative
path, as bytes (vocabulary 256). A file is held out for eval when that hash says so, so the
split does not depend on the seed, the pipeline or the number of bytes read. A user's
corpus is a text file, a folder of text files, or JSONL with a ``"text"`` field; where a
name-based split leaves either part too short (a single file) or holds out more than twice
``eval_fraction`` of the text (a few files), the last ``eval_fraction`` of the token stream
is held out instead. Documents are packed into one stream, each ended by the tokenizer's
end-of-text token (a tokenizer.json's; see ``_end_of_document``), or by a blank line with
byte tokens, whose 256 values leave no id for it.

Batch ``step`` of a run is a pure function of (seed, step): random windows of
``seq_len + 1`` tokens, so any rank, any split and a resumed run see the same batches.
"""

from __future__ import annotations

import json
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pipetrain.config.schema import ConfigError, DataConfig

__all__ = [
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "Tokenizer",
    "eval_batches",
    "load_corpus",
    "load_tokenizer",
    "train_batch",
]

# Between two documents of the byte stream (256 byte values leave no id for an end of
# document), and of a tokenizer's stream when it names no end-of-text token.
_SEPARATOR = b"\n\n"
# Special tokens that end a document in the usual tokenizers, when no tokenizer_config.json
# or config.json beside the tokenizer names one (GPT-2, Llama 1-2 and Mistral, Llama 3,
# Qwen2's documents).
_EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
# Hash buckets for the held-out split: a document is held out when crc32(name) % 10_000
# falls below eval_fraction * 10_000.
_BUCKETS = 10_000


class DataError(ConfigError):
    """Data that cannot be read or is too small for the asked batches."""


class Tokenizer(Protocol):
    """Turns text into token ids and back."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to load, every text encodes."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        # Python reads bytes that are not UTF-8 in a command line as lone surrogates
        # (surrogateescape): they go back to those bytes, each a token like any other.
        return list(text.encode("utf-8", errors="surrogateescape"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class _HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local tokenizer.json."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ModuleNotFoundError:
            raise DataError(
                f"data.tokenizer {path!r} needs the 'tokenizers' package, which is not installed: "
                f"pip install tokenizers, or leave data.tokenizer empty for byte tokens"
            ) from None
        try:
            self._tokenizer = HFTokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise DataError(
                f"data.tokenizer {path!r} is not a readable tokenizer.json ({exc})"
            ) from None

        self.eod_id = _end_of_document(Path(path), self._tokenizer)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode([int(i) for i in ids]))


def _end_of_document(path: Path, tokenizer: Any) -> int | None:
    """The id of the tokenizer's end-of-text token: the ``eos_token`` of a
    tokenizer_config.json beside it, else config.json's ``eos_token_id`` (where the
    tokenizer has that id), else a special token with a usual name; None when there is none
    (documents then join with a blank line)."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id")):
        try:
            value = json.loads((path.parent / name).read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):  # {"content": "</s>", ...}
            value = value.get("content")
        if isinstance(value, list):  # several end tokens (Llama 3.1): the first
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool):
            # An id the tokenizer does not have (a config.json of another tokenizer) would
            # put a token into the data that no text can hold: look further.
            if 0 <= value < tokenizer.get_vocab_size(with_added_tokens=True):
                return value
            continue
        if isinstance(value, str) and tokenizer.token_to_id(value) is not None:
            return int(tokenizer.token_to_id(value))
    for name in _EOD_NAMES:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return int(found)
    return None


def load_tokenizer(path: str) -> Tokenizer:
    """Bytes for ``""``, else the tokenizer.json at ``path``."""
    return _HFTokenizer(path) if path else ByteTokenizer()


@dataclass(frozen=True)
class Corpus:
    """Token streams for training and eval, and the tokenizer that made them."""

    train: np.ndarray  # (N,) token ids
    eval: np.ndarray  # (M,) token ids, disjoint from train
    tokenizer: Tokenizer
    # One line for the run log: where the text came from and how much of it.
    description: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


@dataclass(frozen=True)
class Batch:
    """``inputs[b, t]`` is followed by ``targets[b, t]`` in the text."""

    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64

    @property
    def tokens(self) -> int:
        return int(self.targets.numel())


# ----------------------------------------------------------------------------- documents


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for folder, subfolders, files in os.walk(root):
        # Installed packages are not the standard library and vary between machines.
        subfolders[:] = sorted(
            d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")
        )
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _folder_files(root: Path) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in files:
            if not name.startswith("."):
                path = Path(folder) / name
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _hash(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))


def _read_text(path: Path) -> str | None:
    """The file's text, or None for a file that is not UTF-8 text."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    except OSError as exc:
        raise DataError(f"data.path: cannot read {str(path)!r} ({exc.strerror})") from None


def _jsonl_documents(path: Path) -> Iterator[tuple[str, str]]:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"data.path {str(path)!r} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where} is not JSON ({exc.msg}): write one object per line"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(
                    f'{where} has no string "text" field: write {{"text": "..."}} per line'
                )
            yield f"{path.name}:{number}", record["text"]


def _documents(config: DataConfig) -> tuple[Iterator[tuple[str, str]], str]:
    """(name, text) pairs in corpus order, and where they came from."""
    if not config.path:
        files = sorted(_stdlib_files(), key=lambda item: (_hash(item[0]), item[0]))
        where = f"Python {sysconfig.get_python_version()} standard library"
        return (
            (name, text) for name, path in files if (text := _read_text(path)) is not None
        ), where
    path = Path(config.path)
    if path.is_dir():
        files = sorted(_folder_files(path))
        return (
            (name, text) for name, file in files if (text := _read_text(file)) is not None
        ), str(path)
    if path.suffix == ".jsonl":
        return _jsonl_documents(path), str(path)
    text = _read_text(path)
    if text is None:
        raise DataError(
            f"data.path {config.path!r} is not UTF-8 text: give a text file, folder or .jsonl"
        )
    return iter([(path.name, text)]), str(path)


# ----------------------------------------------------------------------------- corpus


def load_corpus(config: DataConfig) -> Corpus:
    """Read, split and tokenize the corpus of ``config`` (at most ``max_bytes`` of text)."""
    tokenizer = load_tokenizer(config.tokenizer)
    documents, where = _documents(config)
    threshold = round(config.eval_fraction * _BUCKETS)
    eval_budget = config.max_bytes * config.eval_fraction
    train_parts: list[str] = []
    eval_parts: list[str] = []
    train_bytes = eval_bytes = 0
    count = 0
    # Every document read, whole and in corpus order (at most max_bytes): the stream that
    # the fallback below splits, so that none is lost to the held-out budget there.
    read: list[str] = []
    read_bytes = 0
    for name, text in documents:
        if train_bytes >= config.max_bytes and eval_bytes >= eval_budget:
            break
        if read_bytes < config.max_bytes:
            read.append(text[: config.max_bytes - read_bytes])
            read_bytes += len(read[-1])
        # The document that crosses a budget is cut there: one large file would otherwise
        # make the held-out part far more than eval_fraction of a small corpus.
        if _hash(name) % _BUCKETS < threshold:
            if eval_bytes < eval_budget:
                text = text[: max(1, int(eval_budget - eval_bytes))]
                eval_parts.append(text)
                eval_bytes += len(text)
                count += 1
        elif train_bytes < config.max_bytes:
            text = text[: config.max_bytes - train_bytes]
            train_parts.append(text)
            train_bytes += len(text)
            count += 1
    if count == 0:
        raise DataError(
            f"data.path {where!r} holds no text: give a non-empty text file, folder or .jsonl"
        )
    needed = config.seq_len + 1
    train = _encode(train_parts, tokenizer)
    held_out = _encode(eval_parts, tokenizer)
    # A few documents split by name can hold out most of the text (2 of a folder's 3 files
    # was 67% at eval_fraction 0.05), or leave a part too short for one sequence.
    lopsided = len(held_out) > 2 * config.eval_fraction * (len(train) + len(held_out))
    if len(train) < needed or len(held_out) < needed or lopsided:
        # Too few documents for a split by name: hold out the tail of the whole stream.
        stream = _encode(read, tokenizer)
        count = len(read)
        cut = len(stream) - max(needed, int(len(stream) * config.eval_fraction))
        train, held_out = stream[:cut], stream[cut:]
        if len(train) < needed:
            raise DataError(
                f"data.path {where!r} has {len(stream)} tokens, too few for sequences of data.seq_len "
                f"{config.seq_len} plus a held-out part: give more text or a shorter --seq-len"
            )
    description = (
        f"{where}: {count} documents, {len(train):,} train and {len(held_out):,} eval tokens, "
        f"vocabulary {tokenizer.vocab_size}"
    )
    return Corpus(train, held_out, tokenizer, description)


def _encode(parts: list[str], tokenizer: Tokenizer) -> np.ndarray:
    if isinstance(tokenizer, ByteTokenizer):
        # Bytes need no tokenizer pass: one join and a view (uint8 keeps 8 MB as 8 MB).
        return np.frombuffer(_SEPARATOR.join(p.encode("utf-8") for p in parts), dtype=np.uint8)
    ids: list[int] = []
    # Packed documents end with the tokenizer's end-of-text token, as they were trained.
    eod = getattr(tokenizer, "eod_id", None)
    separator = [eod] if eod is not None else tokenizer.encode(_SEPARATOR.decode())
    for i, part in enumerate(parts):
        if i:
            ids.extend(separator)
        ids.extend(tokenizer.encode(part))
    return np.asarray(ids, dtype=np.int64)


# ----------------------------------------------------------------------------- batches


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    index = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (B, T+1)
    tokens = torch.from_numpy(stream[index].astype(np.int64))
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def train_batch(corpus: Corpus, step: int, *, seed: int, batch_size: int, seq_len: int) -> Batch:
    """Batch number ``step``: ``batch_size`` windows drawn from the train stream by (seed, step)."""
    last_start = len(corpus.train) - seq_len - 1
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, last_start + 1, size=batch_size)
    return _windows(corpus.train, starts, seq_len)


def eval_batches(corpus: Corpus, *, batch_size: int, seq_len: int, count: int) -> list[Batch]:
    """``count`` fixed batches of windows spread evenly over the held-out stream."""
    last_start = len(corpus.eval) - seq_len - 1
    starts = np.linspace(0, last_start, num=batch_size * count).astype(np.int64)
    return [
        _windows(corpus.eval, starts[i * batch_size : (i + 1) * batch_size], seq_len)
        for i in range(count)
    ]
