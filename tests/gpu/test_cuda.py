"""On CUDA: the runtime, the split backward and the trainer, where a GPU is present.

CI has no GPU, so these are skipped there (marker ``gpu``, tests/conftest.py); on a
machine with one, ``python -m pytest tests/gpu`` runs them. They check what the CPU tiers
cannot: every tensor the runtime makes lands on the stage's device, the arithmetic of every
schedule holds with CUDA kernels, bf16 autocast runs on CUDA, and the trainer's device
choice, memory report and checkpoints work there. Several GPUs on the node add a real
nccl run compared with the debug mode; with one, the one-line refusal of two ranks on one
GPU is checked instead (nccl cannot place two ranks on one device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipetrain.models import build_full_model, get_model_config, model_spec
from pipetrain.runtime import build_pipeline
from pipetrain.runtime.stage import token_cross_entropy

pytestmark = pytest.mark.gpu

RTOL = 1e-5

SCHEDULES = [
    (name, p, m)
    for p in (2, 4)
    for name, m in (
        ("naive", 4),
        ("gpipe", 4),
        ("1f1b", 4),
        ("interleaved-1f1b", 4),
        ("looped-bfs", 4),
        ("zb-h1", 4),
        ("zb-h2", 8),
        ("zb-v", 4),
        ("dualpipe-v", 8),
        ("v-half", 4),
        ("v-min", 4),
        ("chimera", 4),
    )
]


@pytest.fixture(autouse=True)
def exact_fp32():
    # TF32 rounds matmul inputs to 10 bits of mantissa: the equality tests compare fp32.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def spec():
    # 8 layers, tied embeddings: 4 ranks x 2 chunks have a layer each.
    return model_spec(get_model_config("llama-tiny", n_layers=6, tie_embeddings=True))


def batch(seed: int = 0, b: int = 8, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, t + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100
    return ids[:, :-1], targets


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference(spec, x, y, device):
    full = build_full_model(spec, seed=0, device=device)
    x, y = x.to(device), y.to(device)
    loss = token_cross_entropy(full(x), y) / (y != -100).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in full.named_parameters()}


@pytest.mark.parametrize(
    ("name", "p", "m"), SCHEDULES, ids=[f"{n}-p{p}-m{m}" for n, p, m in SCHEDULES]
)
def test_debug_mode_on_cuda_equals_one_process(spec, name, p, m):
    x, y = batch()
    ref_loss, ref_grads = reference(spec, x, y, "cuda")
    pipe = build_pipeline(spec, schedule=name, ranks=p, microbatches=m, seed=0, device="cuda")
    # The batch may come from the CPU: the pipeline moves it.
    result = pipe.step(x, y)
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    checked = set()
    for module in pipe.modules:
        for pname, param in module.named_parameters(remove_duplicate=False):
            assert param.device.type == "cuda", pname
            key = pipe.tied_names.get(pname, pname)
            assert rel(param.grad, ref_grads[key]) < RTOL, (name, pname)
            checked.add(key)
    assert checked == set(ref_grads)


def test_cuda_and_cpu_start_from_the_same_weights(spec):
    # Weights are drawn on the CPU per (seed, layer) and then moved: the same model anywhere,
    # so the first loss agrees across devices up to kernel rounding.
    x, y = batch(3)
    losses = []
    for device in ("cpu", "cuda"):
        pipe = build_pipeline(spec, schedule="1f1b", ranks=2, microbatches=4, device=device)
        losses.append(pipe.step(x, y).loss)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_bf16_split_backward_equals_plain_backward_on_cuda(spec):
    # zb-h1's I and W under bf16 autocast must give 1f1b's gradients bit for bit.
    x, y = batch(5)
    grads = {}
    for name in ("1f1b", "zb-h1"):
        pipe = build_pipeline(spec, schedule=name, ranks=2, microbatches=4, device="cuda", seed=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pipe.step(x, y)
        grads[name] = {n: q.grad.clone() for n, q in pipe.named_parameters()}
    for n, g in grads["1f1b"].items():
        assert torch.equal(g, grads["zb-h1"][n]), n


def test_adamw_steps_on_cuda_follow_one_process(spec):
    full = build_full_model(spec, seed=0, device="cuda")
    ref_opt = torch.optim.AdamW(full.parameters(), lr=1e-3)
    pipe = build_pipeline(spec, schedule="zb-v", ranks=2, microbatches=4, seed=0, device="cuda")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(3):
        xs, ys = batch(10 + step)
        xc, yc = xs.to("cuda"), ys.to("cuda")
        ref_loss = token_cross_entropy(full(xc), yc) / (yc != -100).sum()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = pipe.step(xs, ys).loss
        opt.step()
        pipe.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), rel=RTOL)
    ref_params = dict(full.named_parameters())
    for name, param in pipe.named_parameters():
        torch.testing.assert_close(
            param, ref_params[pipe.tied_names.get(name, name)], rtol=0, atol=2e-5
        )


# ----------------------------------------------------------------------------- the trainer


def _corpus(root: Path) -> Path:
    data = root / "data"
    data.mkdir()
    words = ["def", "class", "return", "import", "for", "while", "if", "lambda", "self", "x"]
    for i in range(12):
        lines = (" ".join(words[(i + j * 7 + k) % 10] for k in range(10)) for j in range(60))
        (data / f"doc{i:02d}.txt").write_text("\n".join(lines))
    return data


def _train(root: Path, name: str, *flags: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "pipetrain.cli", "train", "--model", "llama-tiny",
        "--data", str(root / "data"), "--batch-size", "8", "--microbatches", "4",
        "--seq-len", "32", "--steps", "6", "--eval-every", "0", "--name", name,
        "--set", "optim.warmup_steps=2",
        "--device", "cuda", *flags,
    ]  # fmt: skip
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return subprocess.run(
        argv, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _records(root: Path, name: str) -> list[dict]:
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _losses(root: Path, name: str) -> list[float]:
    return [r["loss"] for r in _records(root, name) if "loss" in r and not r.get("summary")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    _corpus(root)
    return root


def test_trainer_on_cuda_single_process_matches_pp1(root):
    one = _train(root, "pp1", "--pp", "1")
    assert one.returncode == 0, one.stderr[-3000:]
    piped = _train(root, "sp", "--pp", "2", "--single-process", "--schedule", "zb-h1")
    assert piped.returncode == 0, piped.stderr[-3000:]
    a, b = _losses(root, "pp1"), _losses(root, "sp")
    assert len(a) == 6 and len(b) == 6
    assert a[-1] < a[0]
    # TF32 may be on in the trainer: the two runs agree to a few 1e-3, not to the bit.
    assert b == pytest.approx(a, rel=5e-3)
    # Peak memory comes from the CUDA allocator, not the process's RSS.
    summary = next(r for r in _records(root, "sp") if r.get("summary"))
    assert 0 < max(summary["peak_memory"]) < torch.cuda.get_device_properties(0).total_memory


def test_trainer_on_cuda_bf16_recompute_and_checkpoint(root):
    ckpt = root / "ckpt"
    done = _train(
        root, "bf16", "--pp", "2", "--single-process", "--schedule", "interleaved-1f1b",
        "--chunks", "2", "--precision", "bf16", "--recompute",
        "--checkpoint-dir", str(ckpt),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = _losses(root, "bf16")
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
    assert any(ckpt.iterdir())
    # The checkpoint loads into another layout on the same device.
    again = _train(
        root, "bf16-2", "--pp", "3", "--single-process", "--precision", "bf16",
        "--checkpoint-dir", str(ckpt), "--resume", "--steps", "8",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]


def test_ranks_beyond_the_gpus_of_a_node(root):
    gpus = torch.cuda.device_count()
    done = _train(root, "nccl", "--pp", "2", "--schedule", "1f1b")
    if gpus >= 2:
        # A real nccl pipeline: the same losses as the debug mode.
        assert done.returncode == 0, done.stderr[-3000:]
        ref = _train(root, "nccl-ref", "--pp", "2", "--single-process", "--schedule", "1f1b")
        assert ref.returncode == 0, ref.stderr[-3000:]
        assert _losses(root, "nccl") == pytest.approx(_losses(root, "nccl-ref"), rel=1e-5)
    else:
        assert done.returncode == 2, done.stderr[-3000:]
        assert "ranks 0 and 1 would share GPU" in done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.timeout(900)  # five launches, four of them of two processes
def test_data_parallel_on_nccl_saves_resumes_and_generates(root):
    # The paths only several ranks on nccl take: the (pp, dp) mesh and the replicas'
    # all-reduce, FSDP2 over the dp group, the object collectives of the settings check and
    # of checkpoints (they use the current device), a checkpoint resumed by another layout,
    # and generation over a process group.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from local_port import reserved_port

    ckpt = root / "ckpt-dp"
    ref = _train(root, "dp-ref", "--pp", "1")
    assert ref.returncode == 0, ref.stderr[-3000:]
    for name, flags in (("dp", ()), ("dp-shard", ("--shard",))):
        done = _train(
            root, name, "--pp", "1", "--dp", "2", "--checkpoint-dir", str(ckpt / name), *flags
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # The replicas' mean gradient is the full batch's (TF32 may differ a little).
        assert _losses(root, name) == pytest.approx(_losses(root, "dp-ref"), rel=5e-3)
    again = _train(
        root, "dp-resumed", "--pp", "2", "--schedule", "1f1b",
        "--checkpoint-dir", str(ckpt / "dp"), "--resume", "--steps", "8",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_losses(root, "dp-resumed")) == 2
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    with reserved_port() as port:
        generated = subprocess.run(
            [
                sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "pipetrain.cli", "generate", "--checkpoint", str(ckpt / "dp"),
                "--prompt", "def ", "--max-new-tokens", "5", "--device", "cuda",
            ],
            cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.strip()


def test_packed_messages_on_cuda():
    # A packed message is built and read on the device: the tensors come back as aligned
    # CUDA views equal to what was sent (nccl carries the uint8 buffer as it is).
    from pipetrain.runtime.wire_format import MessageKey, header_values, pack, specs_of, unpack

    key = MessageKey(1, False, 2)
    tensors = (
        torch.randn(2, 3, device="cuda"),
        torch.arange(5, device="cuda"),
        torch.ones(4, dtype=torch.bfloat16, device="cuda"),
    )
    values = header_values(0, 0, key, tensors)
    buf = pack(values, tensors)
    assert buf.device.type == "cuda" and buf.dtype == torch.uint8
    # unpack reads a received buffer, whose transfer is complete: here, the packing.
    torch.cuda.synchronize()
    got_values, got = unpack(buf, specs_of(tensors))
    assert got_values == values
    for want, t in zip(tensors, got, strict=True):
        assert t.device == want.device and torch.equal(t, want)


def test_headers_move_without_waiting_for_queued_compute():
    # Reading a received header and copying one to the device must not wait for the
    # compute queued on the current stream (a .tolist() or a copy from pageable memory
    # would): the host keeps launching kernels ahead of the device.
    from pipetrain.runtime.waits import host_ints, to_device

    received = torch.arange(71, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the device's time on this stream
    assert host_ints(received) == list(range(71))
    header = to_device(list(range(5)), torch.device("cuda"))
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy
    assert header.tolist() == list(range(5))
