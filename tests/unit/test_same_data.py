"""Ranks of one run must read the same text: the check run before the first step."""

from __future__ import annotations

from pathlib import Path

from pipetrain.config import load_config
from pipetrain.data import load_corpus
from pipetrain.train.shared import corpus_fingerprint, data_disagree


def _fingerprint(folder: Path, text: str) -> tuple[str, int, int]:
    folder.mkdir()
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"{text} {i}\n" * 200)
    config = load_config(overrides={"run.name": "t", "data.path": str(folder), "data.seq_len": 16})
    return corpus_fingerprint(load_corpus(config.data))


def test_ranks_that_read_other_text_under_one_path_are_named(tmp_path: Path) -> None:
    ours = _fingerprint(tmp_path / "a", "def f(x): return x")
    again = _fingerprint(tmp_path / "b", "def f(x): return x")
    theirs = _fingerprint(tmp_path / "c", "def g(y): return y")
    assert ours == again and ours != theirs
    # A middle stage reads no data (None); it is neither compared nor blamed.
    assert data_disagree([ours, None, again]) is None
    assert data_disagree([None, None]) is None
    problem = data_disagree([ours, None, theirs])
    assert problem is not None and "\n" not in problem
    assert problem.startswith(
        f"rank 2 read other data than rank 0 ({theirs[1]:,} train and {theirs[2]:,} eval "
        f"tokens against {ours[1]:,} and {ours[2]:,}) from the same data.path: give every "
        "node the same files"
    ), problem


def test_the_same_length_of_other_tokens_differs() -> None:
    import numpy as np

    from pipetrain.data import ByteTokenizer, Corpus

    def corpus(train: list[int]) -> Corpus:
        return Corpus(np.array(train), np.array([1, 2]), ByteTokenizer(), "")

    assert corpus_fingerprint(corpus([1, 2, 3]))[0] != corpus_fingerprint(corpus([1, 2, 4]))[0]
    # Where one stream ends and the other begins counts too.
    a = Corpus(np.array([1, 2, 3]), np.array([4]), ByteTokenizer(), "")
    b = Corpus(np.array([1, 2]), np.array([3, 4]), ByteTokenizer(), "")
    assert corpus_fingerprint(a)[0] != corpus_fingerprint(b)[0]
