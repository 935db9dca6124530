"""The gradient report (``pipetrain.diagnose.grads``): rows, flags, the merge of shards,
the per-stage norms (their squares add up to the global norm's), the short text; and
``Pipeline.grad_report()`` naming a parameter that the forward never uses, in the
single-process debug mode.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from pipetrain.diagnose.grads import (
    GradBounds,
    Measured,
    format_report,
    measure,
    merge,
    report_rows,
    row_json,
    stage_norms,
)
from pipetrain.runtime import build_pipeline


def _m(stage: int, name: str, grad_sq: float | None, weight_sq: float = 4.0, **kw) -> Measured:
    fields = {"numel": 3, "finite": True, "requires_grad": True, "in_norm": True} | kw
    return Measured(stage, name, grad_sq=grad_sq, weight_sq=weight_sq, **fields)


def test_flags_name_what_deserves_a_look() -> None:
    measured = [
        _m(0, "fine", 1.0),
        _m(0, "unused", None),
        _m(0, "frozen", None, requires_grad=False),
        _m(1, "zero", 0.0),
        _m(1, "nan", math.nan, finite=False),
        _m(1, "tiny", 1e-20),
        _m(1, "huge", 1e6),
    ]
    rows = report_rows(measured, GradBounds(vanishing=1e-8, exploding=10.0), step=3)
    flags = {r.name: r.flags for r in rows}
    assert flags == {
        "fine": (),
        "unused": ("no-grad",),
        "frozen": ("no-grad", "frozen"),
        "zero": ("zero",),
        "nan": ("non-finite",),
        "tiny": ("vanishing",),
        "huge": ("exploding",),
    }
    fine = rows[0]
    assert (fine.step, fine.grad_norm, fine.weight_norm, fine.ratio) == (3, 1.0, 2.0, 0.5)
    assert rows[1].grad_norm is None and rows[1].ratio is None
    # A bound of 0 is off.
    off = report_rows(measured, GradBounds(vanishing=0.0, exploding=0.0), step=3)
    assert {r.name: r.flags for r in off}["huge"] == () and off[5].flags == ()


def test_shards_merge_into_one_row_per_stage_and_name() -> None:
    parts = [
        _m(1, "w", 9.0, weight_sq=1.0, numel=2),
        _m(0, "e", 1.0),
        _m(1, "w", 16.0, weight_sq=3.0, numel=2, finite=False),
        _m(1, "u", None),
        _m(1, "u", None),
    ]
    merged = merge(parts)
    assert [(m.stage, m.name) for m in merged] == [(0, "e"), (1, "w"), (1, "u")]
    w = merged[1]
    assert (w.grad_sq, w.weight_sq, w.numel, w.finite) == (25.0, 4.0, 4, False)
    assert merged[2].grad_sq is None  # no gradient on any part
    # A part with a gradient and one without (a shard that held nothing): the gradient wins.
    assert merge([_m(0, "x", None), _m(0, "x", 4.0)])[0].grad_sq == 4.0


def test_stage_norms_squared_add_up_to_the_global_norm_squared() -> None:
    g = torch.Generator().manual_seed(0)
    measured = [
        _m(i % 3, f"p{i}", float(torch.rand((), generator=g)) * 10 ** (i % 4)) for i in range(30)
    ]
    # A tied weight's second copy (not in the norm) and a parameter without a gradient.
    measured += [_m(2, "tied", 100.0, in_norm=False), _m(1, "unused", None)]
    rows = report_rows(measured, GradBounds(), step=1)
    norms = stage_norms(rows)
    global_sq = sum(m.grad_sq for m in measured if m.in_norm and m.grad_sq is not None)
    assert sorted(norms) == [0, 1, 2]
    assert sum(n**2 for n in norms.values()) == pytest.approx(global_sq, rel=1e-6)


def test_measure_takes_local_squares_scaled_as_the_optimizer_sees_them() -> None:
    a = nn.Parameter(torch.tensor([3.0, 4.0]))
    b = nn.Parameter(torch.tensor([1.0]))
    c = nn.Parameter(torch.tensor([2.0]), requires_grad=False)
    a.grad = torch.tensor([6.0, 8.0])
    b.grad = torch.tensor([math.inf])
    got = measure([(0, "a", a), (1, "b", b), (1, "c", c)], scale=0.5, in_norm=lambda n, p: n != "b")
    assert [(m.name, m.stage, m.numel) for m in got] == [("a", 0, 2), ("b", 1, 1), ("c", 1, 1)]
    assert got[0].grad_sq == pytest.approx(25.0) and got[0].weight_sq == pytest.approx(25.0)
    assert got[0].finite and not got[1].finite and not got[1].in_norm
    assert got[2].grad_sq is None and not got[2].requires_grad
    assert measure([]) == []


def test_the_text_is_short_and_the_rows_are_strict_json() -> None:
    measured = [_m(0, f"layers.{i}.w", 1.0) for i in range(200)]
    measured += [_m(1, f"unused.{i}", None) for i in range(15)]
    measured += [_m(1, "nan", math.inf, finite=False)]
    rows = report_rows(measured, GradBounds(), step=7)
    text = format_report(rows, where="runs/x/grad_report.jsonl")
    lines = text.splitlines()
    assert len(lines) <= 14
    assert lines[0].startswith("gradient report, step 7: 216 parameters, 16 flagged")
    assert "runs/x/grad_report.jsonl" in lines[0]
    assert lines[1].startswith("  stage 0: grad norm 14.14 over 200 parameters, 0 flagged")
    assert "! unused.0 (stage 1): no-grad" in text and "and 6 more flagged" in text
    record = json.loads(json.dumps(row_json(rows[-1]), allow_nan=False))
    assert record["grad_norm"] is None and record["flags"] == ["non-finite"]
    assert format_report([]) == "gradient report: no parameters"


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)  # (B, T, C)


class _WithUnused(nn.Module):
    """A block with a parameter its forward forgets: the classic mistake the report names."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gate = nn.Linear(6, 6)  # never called

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 11)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(h)  # (B, T, V)


def test_pipeline_grad_report_names_an_unused_parameter_and_changes_nothing() -> None:
    def build():
        return build_pipeline(
            [_Embed, _WithUnused, _WithUnused, _Head],
            schedule="1f1b",
            ranks=2,
            microbatches=2,
            device="cpu",
            seed=0,
        )

    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    pipe, plain = build(), build()
    loss = pipe.step(ids[:, :-1], ids[:, 1:]).loss
    rows = pipe.grad_report()
    assert plain.step(ids[:, :-1], ids[:, 1:]).loss == loss
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    flagged = {(r.stage, r.name): r.flags for r in rows if r.flags}
    assert flagged == {
        (0, "layers.1.gate.weight"): ("no-grad",),
        (0, "layers.1.gate.bias"): ("no-grad",),
        (1, "layers.2.gate.weight"): ("no-grad",),
        (1, "layers.2.gate.bias"): ("no-grad",),
    }
    assert {r.step for r in rows} == {1}
    by_name = {r.name: r for r in rows}
    head = by_name["layers.3.out.weight"]
    want = torch.linalg.vector_norm(dict(pipe.named_parameters())[head.name].grad).item()
    assert head.grad_norm == pytest.approx(want, rel=1e-6) and head.in_norm
    # Bounds are the caller's: everything with a gradient is "exploding" above 0.
    tight = pipe.grad_report(GradBounds(exploding=1e-12))
    assert all(r.flags in (("exploding",), ("no-grad",)) for r in tight)
