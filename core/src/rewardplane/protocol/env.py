"""Whole-number switches read from the environment, with one clear error for a bad value."""

from __future__ import annotations

import os


def whole_number_from_env(name: str, default: int, meaning: str) -> int:
    """``name``'s value, a whole number >= 1 (``default`` when unset). ``meaning`` says what it
    counts, for the error a bad value raises."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r}: give a whole number >= 1 ({meaning}; default {default})")
    return value
