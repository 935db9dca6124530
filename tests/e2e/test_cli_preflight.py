"""`pipetrain train` refuses bad data, a checkpoint it cannot continue and a --chunks its
schedule would not use before it starts any rank: one line, exit status 2, no config
printed or saved, no process launched (``pipetrain.train.preflight``). Under torchrun,
where the ranks check for themselves, a node's log holds the line once.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_errors import one_line_error
from local_port import reserved_port

import pipetrain.launch.local
from pipetrain.checkpoint import Layout, save_checkpoint
from pipetrain.models import build_stage, get_model_config, model_spec

pytestmark = pytest.mark.e2e

TINY = [
    "--model", "llama-tiny", "--pp", "2", "--steps", "2", "--batch-size", "4",
    "--seq-len", "16", "--microbatches", "2", "--set", "run.sample_tokens=0",
]  # fmt: skip


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch here is a failure of the test: every refusal comes before it."""

    def launched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(pipetrain.launch.local, "launch_local", launched)


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str, pp: str = "2") -> str:
    """The one line of a refused run, which left no run folder behind."""
    argv = ["train", *TINY, "--set", f"run.out_dir={tmp_path / 'runs'}", "--name", "r", *flags]
    argv[argv.index("--pp") + 1] = pp
    line = one_line_error(argv, capsys)
    assert line.startswith("pipetrain train: error: "), line
    assert not (tmp_path / "runs" / "r" / "config.toml").exists()
    return line.removeprefix("pipetrain train: error: ")


@pytest.mark.parametrize("pp", ["1", "2"])
def test_an_empty_data_folder_is_refused_before_any_rank(
    pp: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    line = _refused(tmp_path, capsys, "--data", str(tmp_path / "empty"), pp=pp)
    assert line == (
        f"data.path {str(tmp_path / 'empty')!r} holds no text: give a non-empty text file, "
        "folder or .jsonl"
    )


def test_a_binary_data_file_is_refused_before_any_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    line = _refused(tmp_path, capsys, "--data", str(binary))
    assert (
        line == f"data.path {str(binary)!r} is not UTF-8 text: give a text file, folder or .jsonl"
    )


def test_jsonl_without_text_is_refused_before_any_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = tmp_path / "records.jsonl"
    records.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    line = _refused(tmp_path, capsys, "--data", str(records))
    assert line == (
        f'data.path {str(records)!r} line 2 has no string "text" field: write '
        '{"text": "..."} per line'
    )


@pytest.fixture(scope="module")
def llama_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of llama-tiny at step 3 (its weights as 2 stages)."""
    root = tmp_path_factory.mktemp("preflight") / "ckpt"
    config = get_model_config("llama-tiny")
    spec = model_spec(config)
    stages = [build_stage(spec, range(a, b), seed=1, device="cpu") for a, b in ((0, 3), (3, 6))]
    fields = dataclasses.asdict(config)
    fields.pop("name")
    layout = Layout(pp=2, schedule="1f1b", world_size=2, stages=((0, 1, 2), (3, 4, 5)))
    save_checkpoint(root, 3, modules=stages, model=fields, layout=layout, config={})
    return root


def test_resume_from_a_checkpoint_of_another_model_is_refused_before_any_rank(
    llama_checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], work: Path
) -> None:
    flags = ["--data", str(work / "data"), "--checkpoint-dir", str(llama_checkpoints)]
    line = _refused(tmp_path, capsys, *flags, "--resume", "--model", "gpt2-tiny", "--steps", "9")
    assert line == (
        f"{llama_checkpoints / 'step_000003'} holds a model with family='llama' but this run "
        "has family='gpt2'; use the checkpoint's model settings or another checkpoint directory"
    )
    # The same model, but the checkpoint is past the run's end.
    line = _refused(tmp_path, capsys, *flags, "--resume")
    assert line.startswith(f"{llama_checkpoints / 'step_000003'} is at step 3, past this run's 2")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--schedule", "interleaved-1f1b", "--chunks", "1"],
            "pipeline.chunks 1: interleaved-1f1b runs 2 or more stages per rank (with 1 it "
            "would be 1f1b): use --chunks 2 or more, or --schedule 1f1b",
        ),
        (
            ["--schedule", "zb-v", "--set", "pipeline.chunks=1"],
            "pipeline.chunks 1: zb-v runs 2 stages per rank whatever --chunks says: drop --chunks",
        ),
    ],
)
def test_chunks_that_the_schedule_would_override_are_refused(
    flags: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _refused(tmp_path, capsys, *flags) == expected


def test_under_torchrun_bad_data_is_one_line_in_the_log(tmp_path: Path) -> None:
    """Both ranks of one node read the same bad file and decide together: the node's log
    holds the line once, and no rank's traceback."""
    records = tmp_path / "records.jsonl"
    records.write_text('{"body": "no text field"}\n')
    with reserved_port() as port:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "pipetrain.cli", "train", *TINY, "--data", str(records),
            "--set", f"run.out_dir={tmp_path / 'runs'}", "--set", "pipeline.threads=1",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode != 0  # torchrun's own status, whatever its ranks said
    ours = [line for line in done.stderr.splitlines() if line.startswith("pipetrain train")]
    assert ours == [
        f'pipetrain train: error: data.path {str(records)!r} line 1 has no string "text" '
        'field: write {"text": "..."} per line'
    ], done.stderr[-3000:]
    # torchrun ends in a traceback of its own; none comes from a rank's code.
    assert f"{os.sep}pipetrain{os.sep}" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v", "v-half", "chimera"])
def test_a_config_pipetrain_wrote_is_not_taken_for_a_chunks_request(
    schedule: str, tmp_path: Path
) -> None:
    """runs/<name>/config.toml holds every field, chunks = 1 included: training from it
    again must not be refused as if --chunks 1 were asked for."""
    from pipetrain.cli import build_parser
    from pipetrain.cli.train import _chunks_given
    from pipetrain.config import config_to_toml, load_config

    saved = tmp_path / "config.toml"
    saved.write_text(config_to_toml(load_config(None, {"pipeline.schedule": schedule})))
    assert "chunks = 1" in saved.read_text()
    assert not _chunks_given(build_parser().parse_args(["train", "--config", str(saved)]))
    saved.write_text(saved.read_text().replace("chunks = 1", "chunks = 3"))
    assert _chunks_given(build_parser().parse_args(["train", "--config", str(saved)]))
