"""Weights versioning and the lock that keeps scoring and weight updates apart.

Scoring holds the lock shared, an update holds it exclusively: an update waits for in-flight
batches, new batches wait for the update (writer preference, so a steady stream of scoring cannot
starve a push). The version read under the shared lock is therefore the version that scored.

Sleep (``sleep.py``) takes the lock exclusively too, so it waits for batches in flight and never
cuts one off; while asleep, scoring answers 503 and anything that would change the weights 409.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

from rewardplane.server.errors import Conflict, Unavailable

State = Literal["serving", "updating", "broken", "sleeping"]
WAKE_HINT = "POST /wake first (SDK: client.wake() or `async with handle.awake():`)"


class WeightsGuard:
    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.state: State = "serving"
        self.broken_reason: str | None = None
        self.sleep_level: int | None = None  # set while asleep
        # After a level-2 wake that could not reload the weights: only a push of every parameter (or
        # a restore) repairs them — a partial push would serve garbage next to the pushed part.
        self.needs_full_push = False
        # The version the weights were last committed as by a push, while nothing else wrote them:
        # what a delta push may build on (protocol.weights.delta_refusal). A fresh process and a
        # restore have none (the trainer's record of what was sent may not match what was loaded).
        self.delta_base: int | None = None
        self._awake_state: State = "serving"  # the state to return to on wake
        self._state_before_write: State = "serving"
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._cond = asyncio.Condition()
        self._changed = asyncio.Event()  # set (and replaced) on every change of version or state

    def signal_change(self) -> None:
        """Wake everyone waiting in ``wait_change`` (version, state or an update's outcome changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        """Wait (bounded) for the next ``signal_change``; returns on timeout too."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    @contextlib.asynccontextmanager
    async def scoring(self) -> AsyncIterator[int]:
        """Hold while a batch runs; yields the weights version that will score it."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            if self.state == "sleeping":
                raise Unavailable(
                    f"this replica is asleep (sleep level {self.sleep_level}) and scores nothing until woken: "
                    + WAKE_HINT
                )
            if self.state == "broken":
                raise Unavailable(
                    f"this replica's weights are inconsistent after a failed update ({self.broken_reason}); "
                    "it refuses to score until a later weight update succeeds — retry on another replica "
                    "or push the weights again"
                )
            self._readers += 1
        try:
            yield self.version
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def updating(self, timeout_s: float | None = None, *, waking: bool = False) -> AsyncIterator[None]:
        """Exclusive: waits (bounded) for in-flight batches, blocks new ones until released.
        Refused (409) while asleep, except for the wake itself (``waking``)."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: not self._writer and self._readers == 0), timeout_s
                )
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # scoring waits on writers_waiting too
            refusal = None if waking else self.write_refusal()
            if refusal is not None:
                raise Conflict(refusal)
            self._writer = True
            previous_state = self._state_before_write = self.state
            self.state = "updating"
        try:
            yield
        except BaseException:
            async with self._cond:
                if self.state == "updating":
                    self.state = previous_state
                raise
        finally:
            async with self._cond:
                self._writer = False
                if self.state == "updating":
                    self.state = previous_state
                self._cond.notify_all()
            self.signal_change()

    def commit(self, version: int, *, pushed: bool = True) -> None:
        """Called inside ``updating()`` once the whole update succeeded (``pushed``: by a push, not a
        restore)."""
        self.version = version
        self.delta_base = version if pushed else None
        self.state = "serving"
        self.broken_reason = None
        self.needs_full_push = False
        self.signal_change()

    def write_refusal(self) -> str | None:
        """Why the weights cannot change now (409), or None. ``updating`` refuses with it; paths that
        admit a write before taking the lock (pushes, a restore) ask first."""
        if self.state == "sleeping":
            return (
                f"this replica is asleep (sleep level {self.sleep_level}); its weights cannot change while "
                f"it sleeps: {WAKE_HINT}, then retry"
            )
        return None

    def fall_asleep(self, level: int) -> None:
        """Called inside ``updating()`` once the engine released its memory."""
        self._awake_state = self._state_before_write
        self.state = "sleeping"
        self.sleep_level = level
        self.signal_change()

    def woke(self) -> None:
        """Called inside ``updating(waking=True)`` once the weights are back as they were."""
        self.state = self._awake_state
        self.sleep_level = None
        self.signal_change()

    def mark_broken(self, reason: str, *, needs_full_push: bool = False) -> None:
        """Called inside ``updating()`` when weights were partly overwritten (or, after a level-2
        wake, could not be reloaded: ``needs_full_push``)."""
        self.state = "broken"
        self.broken_reason = reason
        self.delta_base = None
        self.sleep_level = None
        self.needs_full_push = self.needs_full_push or needs_full_push
        self.signal_change()
