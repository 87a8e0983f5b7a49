"""Switches read from the environment (a choice of names, a whole number), each with one clear
error for a bad value."""

from __future__ import annotations

import os
from typing import TypeVar


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


Choice = TypeVar("Choice", bound=str)


def choice_from_env(name: str, choices: tuple[Choice, ...], default: Choice, meanings: str = "") -> Choice:
    """A switch read from the environment variable ``name``: one of ``choices`` (case and spaces
    ignored; unset: ``default``), else a ValueError naming the choices (and ``meanings``)."""
    raw = os.environ.get(name, default).strip().lower()
    for choice in choices:
        if raw == choice:
            return choice
    raise ValueError(f"{name}={raw!r}: give one of {', '.join(choices)} (default {default}){meanings}")
