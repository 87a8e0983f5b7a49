"""Per-key coalescing: work for one key runs at most once at a time; a request that arrives while it
runs makes it run exactly once more (events for one object never pile up or overlap)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Coalescer(Generic[K]):
    def __init__(self, on_waiting: Callable[[int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._running: set[K] = set()
        self._dirty: set[K] = set()
        # told each change (+1, -1) of the keys waiting to run once more (a queue-depth gauge)
        self._on_waiting = on_waiting or (lambda _: None)

    def _add_dirty(self, key: K) -> None:
        if key not in self._dirty:
            self._dirty.add(key)
            self._on_waiting(1)

    def _drop_dirty(self, key: K) -> None:
        if key in self._dirty:
            self._dirty.discard(key)
            self._on_waiting(-1)

    def begin(self, key: K) -> bool:
        """True: the caller now runs the work for ``key``. False: it runs already; it will run again."""
        with self._lock:
            if key in self._running:
                self._add_dirty(key)
                return False
            self._running.add(key)
            return True

    def again(self, key: K) -> bool:
        """After one run: True if requested meanwhile (run once more), else the key is released."""
        with self._lock:
            if key not in self._dirty:
                self._running.discard(key)
                return False
            self._drop_dirty(key)
            return True

    def abandon(self, key: K) -> None:
        with self._lock:
            self._running.discard(key)
            self._drop_dirty(key)

    def mark_dirty(self, key: K) -> None:
        with self._lock:
            self._add_dirty(key)

    def loop(self, key: K, work: Callable[[], None]) -> None:
        """Run ``work`` until no request arrived during the last run (call after ``begin``)."""
        try:
            while True:
                work()
                if not self.again(key):
                    return
        except BaseException:
            self.abandon(key)
            raise

    def run(self, key: K, work: Callable[[], None]) -> None:
        if self.begin(key):
            self.loop(key, work)
