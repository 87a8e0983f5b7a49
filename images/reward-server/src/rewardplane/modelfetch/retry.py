"""Retries of transient failures, with backoff, bounded in time: a fetcher that cannot reach its
server exits 1 within seconds (the kubelet's restart backoff takes over from there)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

from rewardplane.modelfetch.errors import TransientFetchError

T = TypeVar("T")

ATTEMPTS = 3
FIRST_DELAY_S = 1.0


def retrying(
    what: str, call: Callable[[], T], attempts: int = ATTEMPTS, first_delay_s: float = FIRST_DELAY_S
) -> T:
    """``call()``, again after a TransientFetchError (1 s, 2 s, ... later); the last error is raised.
    PermanentFetchError passes through at once."""
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except TransientFetchError as e:
            if attempt == attempts:
                raise
            print(f"{what}: {e} (attempt {attempt} of {attempts}, again in {delay:.0f} s)", file=sys.stderr)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")
