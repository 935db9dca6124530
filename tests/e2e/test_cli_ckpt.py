"""``pipetrain ckpt`` and ``pipetrain generate`` end to end: through main(argv), and as
real processes for the exit statuses and the torchrun path of generate.

On damaged and odd inputs, one line and exit status 2 for what cannot be done, a warning
for a damaged checkpoint that is described: a damaged or unreadable shard, a directory
with only an unfinished save, an export to a directory, a checkpoint deleted while being
read (as a run saving with --keep does), a non-finite --temperature; and the layout of a
V schedule's checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_errors import one_line_error as _one_line_error
from local_port import reserved_port
from torch import nn

from pipetrain.checkpoint import Layout, read_manifest, save_checkpoint
from pipetrain.checkpoint.export import load_weights
from pipetrain.checkpoint.manifest import COMPLETE_MARKER, MANIFEST_NAME
from pipetrain.checkpoint.safetensors_io import read_safetensors
from pipetrain.cli import main
from pipetrain.models import build_full_model, build_stage, get_model_config, model_spec

pytestmark = pytest.mark.e2e

PIPETRAIN = [sys.executable, "-m", "pipetrain.cli"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoints of llama-tiny saved as 2 stages (steps 3 and 6)."""
    root = tmp_path_factory.mktemp("ckpt")
    config = get_model_config("llama-tiny")
    spec = model_spec(config)
    stages = [
        build_stage(spec, range(0, 3), seed=1, device="cpu"),
        build_stage(spec, range(3, 6), seed=1, device="cpu"),
    ]
    fields = dataclasses.asdict(config)
    fields.pop("name")
    layout = Layout(pp=2, chunks=1, schedule="1f1b", world_size=2, stages=((0, 1, 2), (3, 4, 5)))
    for step in (3, 6):
        save_checkpoint(
            root,
            step,
            modules=stages,
            model=fields,
            layout=layout,
            config={"data": {"seq_len": 32, "tokenizer": ""}},
            trainer={"data_step": step},
        )
    return root


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_step_layout_config_and_tensors(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "ckpt", "inspect", str(checkpoints))  # a root: the newest
    assert code == 0, err
    assert f"checkpoint {checkpoints / 'step_000006'}" in out
    assert "step 6, format version 1" in out
    assert "layout: pp=2 chunks=1 schedule=1f1b world_size=2" in out
    assert "stage 1: layers [3, 4, 5]" in out
    assert '"d_model": 32' in out and '"data_step": 6' in out
    assert "model/layers.3.attn.wq.weight" in out and "float32  32x32" in out
    code, out, _ = cli(capsys, "ckpt", "inspect", str(checkpoints / "step_000003"), "--json")
    data = json.loads(out)
    assert data["step"] == 3
    assert data["tensors"]["model/embed.tok.weight"] == {
        "shape": [256, 32],
        "dtype": "float32",
        "bytes": 256 * 32 * 4,
    }
    config = get_model_config("llama-tiny")
    assert data["parameters"] == sum(
        p.numel() for p in build_full_model(model_spec(config), seed=0, device="cpu").parameters()
    )


def test_export_native_and_hf(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "w.safetensors"
    code, out, err = cli(capsys, "ckpt", "export", str(checkpoints), "--out", str(out_file))
    assert code == 0, err
    assert out.startswith(f"wrote {out_file}:")
    full = build_full_model(model_spec(get_model_config("llama-tiny")), seed=9, device="cpu")
    assert load_weights(full, out_file) == ()
    code, _, err = cli(
        capsys,
        "ckpt",
        "export",
        str(checkpoints),
        "--out",
        str(tmp_path / "hf"),
        "--format",
        "hf",
    )
    assert code == 0, err
    hf, _ = read_safetensors(tmp_path / "hf" / "model.safetensors")  # a Hugging Face directory
    assert "model.layers.3.mlp.down_proj.weight" in hf and "lm_head.weight" in hf
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"] == 4


def test_generate_same_text_for_any_number_of_stages(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = []
    for pp in ("1", "3"):
        code, out, err = cli(
            capsys,
            "generate",
            "--checkpoint",
            str(checkpoints),
            "--prompt",
            "def f",
            "--max-new-tokens",
            "12",
            "--temperature",
            "0",
            "--pp",
            pp,
        )
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1]
    assert texts[0].startswith("def f") and len(texts[0].encode()) > len("def f\n")


def test_generate_refuses_bad_input_in_one_line(
    checkpoints: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = cli(
        capsys,
        "generate",
        "--checkpoint",
        str(checkpoints),
        "--prompt",
        "",
        "--max-new-tokens",
        "2",
    )
    assert code == 2 and err.count("\n") == 1 and "the prompt is empty" in err
    code, _, err = cli(capsys, "generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x")
    assert code == 2 and "no such directory" in err

    # A checkpoint from another format version: refused, naming the field.
    old = tmp_path / "old"
    (old).mkdir()
    source = checkpoints / "step_000003"
    for f in source.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    data = json.loads((old / MANIFEST_NAME).read_text())
    data["format_version"] = 0
    text = json.dumps(data).encode()
    (old / MANIFEST_NAME).write_bytes(text)
    (old / COMPLETE_MARKER).write_text(hashlib.sha256(text).hexdigest())
    code, _, err = cli(capsys, "generate", "--checkpoint", str(old), "--prompt", "x")
    assert code == 2 and "format_version 0" in err and err.count("\n") == 1


def test_verify_exit_status_as_a_real_process(
    checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, "ckpt", "verify", str(checkpoints))
    assert code == 0
    assert out.splitlines() == [
        f"ok {checkpoints / name}: step {step}, 2 files, "
        f"{sum(f.stat().st_size for f in (checkpoints / name).glob('[_.]*'))} bytes"
        for step, name in ((3, "step_000003"), (6, "step_000006"))
    ]

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in (checkpoints / "step_000006").iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    victim = sorted(damaged.glob("*.distcp"))[-1]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x80
    victim.write_bytes(bytes(data))
    bad = subprocess.run(
        [*PIPETRAIN, "ckpt", "verify", str(damaged)], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1
    assert f"BAD {damaged}: {victim}: sha256 differs from the manifest" in bad.stdout


def test_generate_across_two_ranks_matches_one_process(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--checkpoint",
        str(checkpoints),
        "--prompt",
        "import ",
        "--max-new-tokens",
        "10",
        "--temperature",
        "0.9",
        "--seed",
        "4",
    ]
    code, expected, err = cli(capsys, *argv)
    assert code == 0, err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with reserved_port() as port:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "pipetrain.cli",
        ]
        result = subprocess.run(
            [*launch, *argv], capture_output=True, text=True, timeout=180, env=env
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_generate_refuses_a_non_finite_temperature(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nan crashed torch.multinomial after loading the model; inf ignored the model.
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--temperature", value]
    assert f"--temperature is {value}" in _one_line_error(argv, capsys)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints of a one-layer model at steps 1 and 2."""
    root = tmp_path_factory.mktemp("sweep") / "ckpt"
    torch.manual_seed(0)
    for step in (1, 2):
        save_checkpoint(root, step, modules=nn.Linear(4, 4), model={"family": "toy"})
    return root


def _copy(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    return copy


def test_inspect_of_a_damaged_checkpoint_warns_and_an_unreadable_one_is_one_line(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = _copy(root, tmp_path)
    shard = copy / "step_000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = cli(capsys, "ckpt", "inspect", str(copy / "step_000002"), "--json")
    problem = f"{shard}: sha256 differs from the manifest (the file is damaged)"
    assert code == 0 and err == f"warning: damaged checkpoint: {problem}\n"
    assert json.loads(out)["problems"] == [problem]
    code, out, err = cli(capsys, "ckpt", "inspect", str(root / "step_000002"), "--json")
    assert code == 0 and err == "" and json.loads(out)["problems"] == []

    metadata = copy / "step_000001" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    code, out, err = cli(capsys, "ckpt", "inspect", str(copy / "step_000001"))
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2
    assert lines[0].startswith(f"warning: damaged checkpoint: {metadata}: 50 bytes")
    assert lines[1].startswith(f"pipetrain ckpt: error: {metadata}: unreadable (UnpicklingError")


def test_verify_of_a_directory_with_only_an_unfinished_save_names_it(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    partial = crashed / "step_000003.tmp-0123abcd"
    shutil.copytree(root / "step_000001", partial)
    code, out, _ = cli(capsys, "ckpt", "verify", str(crashed))
    assert code == 1
    assert out.splitlines() == [
        f"note {partial}: an unfinished save, ignored",
        f"{crashed}: no checkpoints (step_NNNNNN directories) found",
    ]


def test_export_to_a_directory_is_one_line(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(capsys, "ckpt", "export", str(root), "--out", str(tmp_path))
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"pipetrain ckpt: error: cannot write the export to {tmp_path}: it is a directory; "
        f"pass --out a file path such as {tmp_path / 'model.safetensors'}"
    ]


def test_export_of_a_directory_names_the_checkpoint_and_all_damaged_says_so(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "w.safetensors"
    code, out, err = cli(capsys, "ckpt", "export", str(root), "--out", str(out_file))
    assert code == 0, err
    assert out.startswith(f"wrote {out_file}: ")
    assert out.rstrip("\n").endswith(f"(native), from {root / 'step_000002'}")

    copy = _copy(root, tmp_path)
    shards = [next((copy / f"step_00000{step}").glob("*.distcp")) for step in (1, 2)]
    for shard in shards:
        shard.write_bytes(shard.read_bytes()[:10])
    for argv in (
        ["ckpt", "export", str(copy), "--out", str(out_file)],
        ["ckpt", "inspect", str(copy)],
    ):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == ""
        line = err.splitlines()[-1]
        # It said the directory held no step_NNNNNN with a COMPLETE marker: both have one.
        assert line.startswith(
            f"pipetrain ckpt: error: checkpoint {copy}: no valid checkpoint: {shards[1]}: 10 bytes"
        )
        assert line.endswith(
            "(and 1 more damaged); restore the damaged files, or pass another checkpoint"
        )


def test_a_v_schedules_checkpoint_says_two_stages_per_rank(
    work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = work / "ckpt_v"
    argv = [
        "train", "--model", "llama-tiny", "--pp", "2", "--schedule", "zb-v", "--single-process",
        "--steps", "1", "--batch-size", "4", "--microbatches", "4", "--seq-len", "8",
        "--eval-every", "0", "--set", "run.evaluate=false", "--set", "run.sample_tokens=0",
        "--set", "optim.warmup_steps=0", "--data", str(work / "data"),
        "--set", f"run.out_dir={work / 'runs'}", "--name", "v", "--checkpoint-dir", str(ckpt),
    ]  # fmt: skip
    code, _, err = cli(capsys, *argv)
    assert code == 0, err
    # It said chunks=1 (pipeline.chunks, which the V schedules ignore) beside 4 stages.
    layout = read_manifest(ckpt / "step_000001").layout
    assert (layout.pp, layout.chunks, len(layout.stages)) == (2, 2, 4)
    code, out, err = cli(capsys, "ckpt", "inspect", str(ckpt))
    assert code == 0, err
    assert "layout: pp=2 chunks=2 schedule=zb-v world_size=1" in out


def test_a_checkpoint_deleted_while_being_read_is_said_to_be_gone_not_damaged(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training run saving into the directory with --keep deletes its oldest checkpoint
    # while export, inspect, generate or verify reads it: here, as the read begins.
    import pipetrain.checkpoint
    import pipetrain.checkpoint.export

    copy = _copy(root, tmp_path)
    real_export = pipetrain.checkpoint.export.export_checkpoint

    def export_pruned(path: Path, *args: object, **kwargs: object) -> object:
        shutil.rmtree(path)
        return real_export(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipetrain.checkpoint.export, "export_checkpoint", export_pruned)
    code, out, err = cli(capsys, "ckpt", "export", str(copy), "--out", str(tmp_path / "m.st"))
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"pipetrain ckpt: error: checkpoint {copy / 'step_000002'} was deleted while being read "
        "(a training run saving there with --keep removes its oldest): run the command again "
        "to read the newest"
    ]
    monkeypatch.undo()

    real_verify = pipetrain.checkpoint.verify_checkpoint

    def verify_pruned(path: Path, **kwargs: bool) -> object:
        if path.name == "step_000001":
            shutil.rmtree(path)
        return real_verify(path, **kwargs)

    monkeypatch.setattr(pipetrain.checkpoint, "verify_checkpoint", verify_pruned)
    code, out, _ = cli(capsys, "ckpt", "verify", str(copy))
    assert code == 0, out
    assert f"note {copy / 'step_000001'}: deleted while being verified" in out
    assert "BAD" not in out
