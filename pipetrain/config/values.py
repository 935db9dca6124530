"""The checks every section of ``pipetrain.config.schema`` applies to single values.

Each raises ``ConfigError`` with one line that names the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipetrain.config.errors import ConfigError

__all__ = ["at_least", "check_values", "one_of", "run_name_error"]


def check_values(section: str, table: Any) -> None:
    """NaN or infinity in any float field: a run that would diverge, hang or crash late.

    Also text that is not Unicode (bytes that are not UTF-8 in an argument reach Python
    as lone surrogates): the config saved for a launched run could not hold it. Run after
    a section's own checks, whose messages are more specific for the fields they cover.
    """
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        key = f"{section}.{f.name}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} is {value}: give a finite number (default {f.default})")
        if isinstance(value, str) and not _is_unicode(value):
            raise ConfigError(f"{key} {value!r} is not valid UTF-8 text: fix its value")


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"{key} is {value}: it must be at least {low}")


def one_of(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} is {value!r}: use one of {', '.join(choices)}")


def run_name_error(name: str) -> str:
    """The message for a run name that is not a plain folder name."""
    return f"run.name {name!r} is not a plain folder name: use letters, digits, '.', '_' and '-'"


def recomputing_ranks(recompute: bool, ranks: str, pp: int) -> frozenset[int]:
    """``pipeline.recompute`` (every rank) or ``pipeline.recompute_ranks`` ("0,2") as the
    set of pipeline ranks that recompute; ``ConfigError`` for a bad list."""
    if recompute and ranks:
        raise ConfigError(
            f"pipeline.recompute already recomputes on every rank and pipeline.recompute_ranks "
            f"{ranks!r} names some: drop one of --recompute and --recompute-ranks"
        )
    if recompute:
        return frozenset(range(pp))
    if not ranks:
        return frozenset()
    parts = [r.strip() for r in ranks.split(",")]
    if not all(r.isdigit() for r in parts) or len({int(r) for r in parts}) != len(parts):
        raise ConfigError(
            f"pipeline.recompute_ranks {ranks!r}: give distinct pipeline ranks separated by "
            f"commas, e.g. 0,1"
        )
    over = [int(r) for r in parts if int(r) >= pp]
    if over:
        raise ConfigError(
            f"pipeline.recompute_ranks names rank {over[0]}, but pipeline.pp is {pp} (ranks "
            f"0..{pp - 1}): name ranks below {pp}"
        )
    return frozenset(int(r) for r in parts)


BALANCES = ("uniform", "params", "cost")


def check_split(split: str, balance: str) -> None:
    """``pipeline.split`` and ``pipeline.balance``: one of them chooses the split."""
    if balance not in BALANCES:
        raise ConfigError(
            f"pipeline.balance is {balance!r}: use one of {', '.join(BALANCES)} (or give blocks "
            f"per stage with --split, e.g. 4,3,5)"
        )
    if split and balance != "uniform":
        raise ConfigError(
            f"pipeline.split {split!r} and pipeline.balance {balance!r} both choose the split: "
            f"drop one of --split and --balance"
        )
