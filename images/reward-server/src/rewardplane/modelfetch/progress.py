"""Progress lines on stdout (``FetchProgress.line()``), which the operator reads back into the
RewardModel's status: at most about one a second, plus one at each phase change and at the end."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from rewardplane.protocol.model_sources import FetchProgress

INTERVAL_S = 1.0


class Progress:
    """Thread-safe: the download workers add bytes from several threads."""

    def __init__(self, out: TextIO | None = None, interval_s: float = INTERVAL_S) -> None:
        self._out = out or sys.stdout
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last_print = 0.0
        self._state = FetchProgress(phase="listing")

    @property
    def state(self) -> FetchProgress:
        return self._state

    def phase(
        self,
        phase: str,
        *,
        bytes_done: int = 0,
        bytes_total: int | None = None,
        files_done: int = 0,
        files_total: int | None = None,
    ) -> None:
        """Enter a phase (always printed)."""
        with self._lock:
            self._state = FetchProgress(phase, bytes_done, bytes_total, files_done, files_total)
            self._print()

    def add(self, nbytes: int, files: int = 0) -> None:
        """Count bytes (negative: a failed attempt's bytes, downloaded again) and finished files."""
        with self._lock:
            s = self._state
            self._state = FetchProgress(
                s.phase, max(0, s.bytes_done + nbytes), s.bytes_total, s.files_done + files, s.files_total
            )
            if time.monotonic() - self._last_print >= self._interval:
                self._print()

    def set_total(self, bytes_total: int | None) -> None:
        with self._lock:
            s = self._state
            self._state = FetchProgress(s.phase, s.bytes_done, bytes_total, s.files_done, s.files_total)

    def _print(self) -> None:
        self._last_print = time.monotonic()
        print(self._state.line(), file=self._out, flush=True)
