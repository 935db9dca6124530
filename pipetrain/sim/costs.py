"""Costs from text (``"F=1,B=2,I=1,W=1"``) and spread over a schedule's stages.

The text form is the ``--costs`` flag of ``pipetrain simulate``: comma-separated
``KEY=VALUE`` pairs, a value being one number or one number per model stage joined by
``/``. Errors name the flag, since that is where the text comes from.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pipetrain.errors import InputError
from pipetrain.schedules.execution import Costs
from pipetrain.schedules.schedule import Schedule

__all__ = [
    "COST_KEYS",
    "CostsError",
    "check_stage_costs",
    "parse_costs",
    "stage_costs",
    "stage_share",
]

# Text key -> Costs field.
COST_KEYS: dict[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "backward_input",
    "W": "backward_weight",
    "ALLREDUCE": "allreduce",
    "STEP": "step",
}
# Keys that may differ per model stage (the others are one number for the whole step).
_PER_STAGE_KEYS = frozenset({"F", "B", "I", "W"})

_Value = float | tuple[float, ...]


class CostsError(InputError):
    """Cost text or numbers that cannot describe a schedule's durations."""


def _value(key: str, text: str) -> _Value:
    parts = text.split("/")
    if len(parts) > 1 and key not in _PER_STAGE_KEYS:
        raise CostsError(f"--costs {key}={text}: {key} takes one number, not one per stage")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise CostsError(
                f"--costs {key}={text}: {part!r} is not a number; write e.g. {key}=1.5"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise CostsError(f"--costs {key}={text}: durations must be finite and >= 0")
        values.append(value)
    return values[0] if len(values) == 1 else tuple(values)


def _halve(value: _Value) -> _Value:
    return tuple(v / 2 for v in value) if isinstance(value, tuple) else value / 2


def _pair(a: _Value, b: _Value, names: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Two values as equally long tuples (a scalar stands for every stage)."""
    n = max(len(x) if isinstance(x, tuple) else 1 for x in (a, b))
    left = a if isinstance(a, tuple) else (a,) * n
    right = b if isinstance(b, tuple) else (b,) * n
    if len(left) != len(right):
        raise CostsError(f"--costs: {names} give different numbers of stages; give as many of each")
    return left, right


def _add(a: _Value, b: _Value) -> _Value:
    if not isinstance(a, tuple) and not isinstance(b, tuple):
        return a + b
    left, right = _pair(a, b, "I and W")
    return tuple(x + y for x, y in zip(left, right, strict=True))


def _rest(whole: _Value, part: _Value, key: str) -> _Value:
    """B minus one half of it: the other half."""
    left, right = _pair(whole, part, f"B and {key}")
    rest = tuple(x - y for x, y in zip(left, right, strict=True))
    if any(r < 0 for r in rest):
        raise CostsError(f"--costs: {key} is longer than B, but B = I + W: lower {key} or raise B")
    return rest if any(isinstance(v, tuple) for v in (whole, part)) else rest[0]


def _complete_backward(given: dict[str, _Value]) -> None:
    """Fill in B, I and W so that B = I + W whatever subset was given.

    A schedule that splits the backward (I, W) and one that does not (B) must describe the
    same backward, or a comparison is wrong: ``B=4,W=0.5`` with I left at its default 1
    made ZB-H1 look twice as fast as 1F1B.
    """
    b, i, w = given.get("B"), given.get("I"), given.get("W")
    if b is None:
        if i is None and w is None:
            return
        i = 1.0 if i is None else i  # the unit default of the half not given
        w = 1.0 if w is None else w
        given.update(I=i, W=w, B=_add(i, w))
    elif i is None and w is None:
        given["I"] = given["W"] = _halve(b)
    elif w is not None and i is None:
        given["I"] = _rest(b, w, "W")
    elif i is not None and w is None:
        given["W"] = _rest(b, i, "I")
    elif i is not None and w is not None:
        total, whole = _pair(_add(i, w), b, "B and I + W")
        if not all(
            math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
            for x, y in zip(total, whole, strict=True)
        ):
            raise CostsError(
                "--costs: B must equal I + W (the backward is its input and weight halves): "
                "give B alone, I and W alone, or all three adding up"
            )


def parse_costs(
    text: str,
    *,
    latency: float = 0.0,
    bandwidth: float | None = None,
    message_bytes: float = 0.0,
) -> Costs:
    """``"F=1,B=2,I=1,W=1"`` -> ``Costs``; missing keys keep the unit defaults.

    B alone sets I = W = B/2, I and W set B = I + W, B and one half set the other half (a
    half given alone leaves the other at 1), and all three must add up: a schedule with the
    backward split and one without describe the same backward.
    """
    given: dict[str, _Value] = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        raw_key, sep, raw_value = item.partition("=")
        key = raw_key.strip().upper()
        if not sep or key not in COST_KEYS:
            raise CostsError(
                f"--costs {item!r}: write KEY=NUMBER pairs separated by commas, "
                f"keys {', '.join(COST_KEYS)}, e.g. --costs F=1,B=2,I=1,W=1"
            )
        if key in given:
            raise CostsError(f"--costs: {key} is given twice; give it once")
        given[key] = _value(key, raw_value.strip())
    _complete_backward(given)
    for flag, amount in (("--latency", latency), ("--message-bytes", message_bytes)):
        if not math.isfinite(amount) or amount < 0:
            raise CostsError(f"{flag} {amount:g}: give a finite number >= 0")
    if bandwidth is not None and (not math.isfinite(bandwidth) or bandwidth <= 0):
        raise CostsError(f"--bandwidth {bandwidth:g}: give a number > 0 (bytes per time unit)")
    fields: dict[str, Any] = {COST_KEYS[k]: v for k, v in given.items()}
    return Costs(latency=latency, bandwidth=bandwidth, message_bytes=message_bytes, **fields)


def check_stage_costs(costs: Costs, schedule: Schedule) -> None:
    """Per-stage costs must give one number per model stage of ``schedule``."""
    stages = schedule.placement.num_model_stages
    for key, field in COST_KEYS.items():
        value = getattr(costs, field)
        if isinstance(value, tuple) and len(value) != stages:
            raise CostsError(
                f"--costs {key}: {len(value)} numbers for {stages} model stages of "
                f"{schedule.name}; give one number or {stages} joined by '/'"
            )


def stage_share(schedule: Schedule) -> float:
    """The part of one rank's share of the model that one stage holds: 1/v, where v is
    the number of stages per rank (1 for Chimera, whose two stages per rank are replicas
    of whole stages)."""
    return schedule.num_ranks / schedule.placement.num_model_stages


def stage_costs(costs: Costs, schedule: Schedule) -> Costs:
    """Costs given for one rank's share of the model, spread over ``schedule``'s stages.

    One-number F, B, I, W are the time of a rank's share, so a schedule with v stages per
    rank spends 1/v of it per stage and schedules compare on the same model. Per-stage
    tuples are each stage's own time and stay as they are; so do latency, all-reduce and
    step times.
    """
    check_stage_costs(costs, schedule)
    factor = stage_share(schedule)
    if factor == 1:
        return costs
    fields: dict[str, Any] = {}
    for key in _PER_STAGE_KEYS:
        value = getattr(costs, COST_KEYS[key])
        if not isinstance(value, tuple):
            fields[COST_KEYS[key]] = value * factor
    return replace(costs, **fields)
