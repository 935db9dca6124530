"""Models: presets, split-independent weights, global names, chained forward, user layers,
and preset fields a model would ignore or could not use (GPT-2's n_kv_heads, an infinite
norm_eps or rope_theta) refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from pipetrain.errors import InputError
from pipetrain.models import (
    PRESETS,
    LayerSpec,
    PipelineSpec,
    StageModule,
    build_full_model,
    build_stage,
    get_model_config,
    model_spec,
)
from pipetrain.models.config import parse_overrides

TINY = ("llama-tiny", "gpt2-tiny")


def _splits(n_layers: int) -> list[list[range]]:
    """A few ways to cut n_layers consecutive layers, including one layer per stage."""
    return [
        [range(0, 1), range(1, n_layers)],
        [range(0, n_layers - 1), range(n_layers - 1, n_layers)],
        [range(0, 2), range(2, 4), range(4, n_layers)],
        [range(i, i + 1) for i in range(n_layers)],
    ]


def _stages(spec: PipelineSpec, split: list[range], seed: int = 7) -> list[StageModule]:
    return [build_stage(spec, r, seed=seed, device="cpu") for r in split]


def test_presets_are_valid_and_named() -> None:
    assert {
        "llama-tiny",
        "gpt2-tiny",
        "llama-default",
        "gpt2-124m",
        "llama3-1b",
        "llama3-8b",
    } <= set(PRESETS)
    default = get_model_config("llama-default")
    assert (default.family, default.n_layers, default.vocab_size, default.d_model) == (
        "llama",
        12,
        256,
        128,
    )
    for name in TINY:
        config = get_model_config(name)
        assert 2 <= config.n_layers <= 4 and config.d_model <= 64 and config.vocab_size == 256


def test_real_sizes_have_the_published_parameter_counts() -> None:
    def count(name: str) -> int:
        spec = model_spec(get_model_config(name))
        total = 0
        for layer in spec.layers:
            with torch.device("meta"):
                total += sum(p.numel() for p in layer.build().parameters())
        # A tied head shares the embedding matrix: count it once.
        return total - sum(
            get_model_config(name).vocab_size * get_model_config(name).d_model for _ in spec.tied
        )

    assert count("gpt2-124m") == pytest.approx(124.4e6, rel=0.01)
    assert count("llama3-1b") == pytest.approx(1.236e9, rel=0.01)
    assert count("llama3-8b") == pytest.approx(8.03e9, rel=0.01)


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(InputError, match=r"llama-tiny.*gpt2-tiny"):
        get_model_config("llama-huge")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_heads": 5}, "d_model"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"colour": 1}, "colour"),
    ],
)
def test_bad_config_fields_are_named(overrides: dict[str, int], field: str) -> None:
    with pytest.raises(InputError, match=field):
        get_model_config("llama-tiny", **overrides)


def test_overrides_replace_fields() -> None:
    assert get_model_config("llama-tiny", n_layers=6).n_layers == 6
    parsed = parse_overrides(["n_layers=6", "tie_embeddings=true", "norm_eps=1e-6"])
    assert parsed == {"n_layers": 6, "tie_embeddings": True, "norm_eps": 1e-6}
    for bad, field in (
        (["colour=red"], "colour"),
        (["n_layers=six"], "n_layers"),
        (["d_model"], "d_model"),
    ):
        with pytest.raises(InputError, match=field):
            parse_overrides(bad)


@pytest.mark.parametrize("name", TINY)
def test_weights_do_not_depend_on_the_split(name: str) -> None:
    spec = model_spec(get_model_config(name))
    full = build_full_model(spec, seed=7, device="cpu").state_dict()
    for split in _splits(len(spec)):
        seen: set[str] = set()
        for stage in _stages(spec, split):
            for key, tensor in stage.state_dict().items():
                assert key in full, f"{key} is not a global name"
                assert torch.equal(tensor, full[key]), f"{key} differs in split {split}"
                seen.add(key)
        assert seen == set(full)


def test_different_seeds_give_different_weights() -> None:
    spec = model_spec(get_model_config("llama-tiny"))
    a = build_stage(spec, [1], seed=1, device="cpu").state_dict()
    b = build_stage(spec, [1], seed=2, device="cpu").state_dict()
    assert not torch.equal(a["layers.0.attn.wq.weight"], b["layers.0.attn.wq.weight"])


@pytest.mark.parametrize("name", TINY)
def test_stages_keep_global_names(name: str) -> None:
    spec = model_spec(get_model_config(name))
    n = len(spec)
    first, middle, last = (
        build_stage(spec, r, seed=0, device="cpu") for r in ([0, 1], [2, 3], range(4, n))
    )
    assert all(k.startswith(("embed.", "layers.0.")) for k in first.state_dict())
    assert {k.split(".")[1] for k in middle.state_dict()} == {"1", "2"}
    assert "layers.1.attn.wq.weight" in middle.state_dict()
    assert any(k.startswith("head.") for k in last.state_dict())
    assert (first.is_first, first.is_last, last.is_first, last.is_last) == (
        True,
        False,
        False,
        True,
    )
    assert middle.layer_indices == (2, 3)


@pytest.mark.parametrize("name", TINY)
def test_chained_stages_compute_the_full_forward(name: str) -> None:
    spec = model_spec(get_model_config(name))
    full = build_full_model(spec, seed=3, device="cpu")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = full(ids)
    assert expected.shape == (2, 16, 256)
    for split in _splits(len(spec)):
        x = ids
        for stage in _stages(spec, split, seed=3):
            x = stage(x)
        torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_dtype_and_meta_build_only_the_stage_layers() -> None:
    spec = model_spec(get_model_config("llama-tiny"))
    stage = build_stage(spec, [2], seed=0, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}
    assert all(k.startswith("layers.1.") for k in stage.state_dict())
    assert all(p.device.type == "cpu" for p in stage.parameters())


@pytest.mark.parametrize("indices", [[], [0, 2], [5, 6, 99], [-1]])
def test_bad_stage_indices_are_rejected(indices: list[int]) -> None:
    spec = model_spec(get_model_config("llama-tiny"))
    with pytest.raises(InputError, match=r"layer|stage"):
        build_stage(spec, indices, seed=0, device="cpu")


class _Scale(nn.Module):
    """A user layer with a raw parameter and no init_weights."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_user_layer_list_pipelines_like_the_full_model() -> None:
    spec = PipelineSpec.from_layers(
        [
            lambda: nn.Linear(4, 8),
            lambda: nn.Sequential(nn.Tanh(), nn.Linear(8, 8)),
            _Scale,
            LayerSpec("readout", "head", lambda: nn.Linear(8, 3)),
        ]
    )
    assert [layer.name for layer in spec.layers] == ["layers.0", "layers.1", "layers.2", "readout"]
    full = build_full_model(spec, seed=11, device="cpu")
    x = torch.randn(5, 4)
    for split in ([range(0, 2), range(2, 4)], [range(0, 1), range(1, 3), range(3, 4)]):
        stages = _stages(spec, split, seed=11)
        for stage in stages:
            for key, tensor in stage.state_dict().items():
                assert torch.equal(tensor, full.state_dict()[key]), key
        y = x
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, full(x), rtol=0, atol=0)


def test_user_layer_list_rejects_clashing_names() -> None:
    with pytest.raises(InputError, match="clash"):
        PipelineSpec.from_layers(
            [LayerSpec("a", "block", nn.ReLU), LayerSpec("a.b", "block", nn.ReLU)]
        )
    with pytest.raises(InputError, match="kind"):
        LayerSpec("a", "decoder", nn.ReLU)


def test_gpt2_rejects_sequences_longer_than_its_positions() -> None:
    spec = model_spec(get_model_config("gpt2-tiny"))
    first = build_stage(spec, [0], seed=0, device="cpu")
    with pytest.raises(InputError, match="max_seq_len"):
        first(torch.zeros(1, 65, dtype=torch.long))


def test_building_stages_does_not_import_dynamo() -> None:
    # Random init on the meta device imports torch._dynamo: seconds at every rank's start.
    code = (
        "import sys; from pipetrain.models import build_stage, get_model_config, model_spec\n"
        "for name in ('llama-tiny', 'gpt2-tiny'):\n"
        "    spec = model_spec(get_model_config(name))\n"
        "    build_stage(spec, range(len(spec)), seed=0, device='cpu')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_gpt2_refuses_grouped_query_attention_it_would_ignore() -> None:
    # GPT-2's attention projects keys and values at full width whatever n_kv_heads says, so
    # --set n_kv_heads=2 planned and built plain multi-head attention without a word.
    with pytest.raises(InputError, match="set n_kv_heads=4"):
        get_model_config("gpt2-tiny", n_kv_heads=2)
    assert get_model_config("llama-tiny", n_kv_heads=1).n_kv_heads == 1


@pytest.mark.parametrize("field", ["norm_eps", "rope_theta"])
def test_an_infinite_norm_eps_or_rope_theta_is_refused(field: str) -> None:
    # Both passed the "> 0" check: an infinite norm_eps makes every normalised activation 0.
    with pytest.raises(InputError, match=f"model {field} must be finite and > 0"):
        get_model_config("llama-tiny", **{field: float("inf")})
