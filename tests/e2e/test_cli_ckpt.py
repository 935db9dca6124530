"""``pipetrain ckpt`` and ``pipetrain generate`` end to end: through main(argv), and as
real processes for the exit statuses and the torchrun path of generate."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from local_port import reserved_port

from pipetrain.checkpoint import Layout, save_checkpoint
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
        str(tmp_path / "hf.safetensors"),
        "--format",
        "hf",
    )
    assert code == 0, err
    hf, _ = read_safetensors(tmp_path / "hf.safetensors")
    assert "model.layers.3.mlp.down_proj.weight" in hf and "lm_head.weight" in hf


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
