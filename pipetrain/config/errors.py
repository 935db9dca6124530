"""``ConfigError``: the error of a config value that is unknown, of the wrong type, or out
of range. Its own module, so the schema, the loader and the checks all raise it without
importing each other."""

from __future__ import annotations

from pipetrain.errors import InputError

__all__ = ["ConfigError"]


class ConfigError(InputError):
    """A config value that is unknown, of the wrong type, or contradicts another one."""
