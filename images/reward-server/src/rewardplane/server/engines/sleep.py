"""Sleep and wake (``POST /sleep``, ``POST /wake``; the rules are in ``rewardplane.protocol.sleep``).

The engine releases and retakes its memory (``RewardEngine.sleep``/``wake``); this service decides
when that may happen and what the replica serves afterwards:

- a transition holds the weights lock exclusively (``WeightsGuard.updating``), so it waits —
  bounded by ``timeout_s`` — for scoring in flight, and no batch starts meanwhile;
- sleep and wake run one at a time, and each is idempotent;
- a push, restore or peer send while asleep is refused with 409 (the lock refuses writers while
  asleep, so a push accepted just before the sleep fails cleanly instead of writing into freed
  memory); waking is the caller's decision (the SDK's ``async with handle.awake():``), because a
  wake costs a copy of the weights (level 1) or a reload (level 2) and puts memory back on a GPU
  an actor may be using;
- after a level-2 wake the weights are rebuilt — the base checkpoint, then the pushed weights saved
  in ``--weights-dir`` for the served version (or the saved weights alone when they cover every
  parameter). When that is impossible (no saved copy of a pushed version, random dummy weights),
  the replica is marked broken and refuses to score until a full push or a restore: it never
  scores with weights other than those of its version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from rewardplane.protocol import ParamMeta, SleepResponse
from rewardplane.server.engines.engine import RewardEngine, WeightSyncPort
from rewardplane.server.errors import Conflict, ServerError, Unavailable
from rewardplane.server.metrics import ServerMetrics
from rewardplane.server.weight_sync.persistence import WeightsStore
from rewardplane.server.weight_sync.worker_calls import WorkerCalls

log = logging.getLogger(__name__)

# A level-2 wake told not to reload: the memory is back, the weights are the next full push's.
UNLOADED = (
    "woke from a level-2 sleep without reloading the weights (reload false): push the full weights; "
    "scoring answers 503 until then"
)


class SavedWeights(Protocol):
    """What sleeping and waking need of the control plane (``weight_sync.control_plane``'s
    ``WeightSyncService``; engines do not import it)."""

    @property
    def port(self) -> WeightSyncPort: ...

    @property
    def manifest(self) -> dict[str, ParamMeta]: ...

    def busy(self) -> bool:
        """A weight update or peer send is running."""
        ...

    async def restorable(self, version: int) -> WeightsStore:
        """The store, once it is sure to hold ``version`` (else ``Conflict`` saying what to do)."""
        ...

    async def load_saved(self, version: int) -> int:
        """Inside the exclusive lock: load the saved ``version`` in every worker."""
        ...


class SleepService:
    def __init__(self, engine: RewardEngine, weights: SavedWeights, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.weights = weights
        self.metrics = metrics
        self._transition_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, timeout_s: float) -> AsyncIterator[None]:
        try:
            await asyncio.wait_for(self._transition_lock.acquire(), timeout_s)
        except TimeoutError as exc:
            raise Unavailable(
                f"another sleep or wake did not finish within timeout_s={timeout_s:g}s; retry"
            ) from exc
        try:
            yield
        finally:
            self._transition_lock.release()

    def answer(
        self, *, changed: bool, seconds: float = 0.0, freed: int | None = None, detail: str | None = None
    ) -> SleepResponse:
        g = self.engine.guard
        asleep = g.state == "sleeping"
        return SleepResponse(
            state="sleeping" if asleep else "awake",
            level=g.sleep_level if asleep else None,
            changed=changed,
            seconds=round(seconds, 6),
            version=g.version,
            weights="asleep" if asleep else g.state,
            device_bytes_freed=freed,
            detail=detail if detail is not None else g.broken_reason,
        )

    async def sleep(self, level: int, timeout_s: float) -> SleepResponse:
        problem = self.engine.sleep_problem()
        if problem is not None:
            raise Conflict(problem)
        guard = self.engine.guard
        async with self._one_at_a_time(timeout_s):
            if guard.state == "sleeping":
                if guard.sleep_level == level:
                    return self.answer(changed=False)
                raise Conflict(
                    f"this replica already sleeps at level {guard.sleep_level}; wake it (POST /wake) before "
                    f"sleeping at level {level}"
                )
            if self.weights.busy():
                raise Conflict(
                    "a weight update or peer send is in progress; sleep after it finishes "
                    "(GET /get_num_background_tasks shows it)"
                )
            start = time.monotonic()
            try:
                async with guard.updating(timeout_s=timeout_s):
                    try:
                        freed = await self.engine.sleep(level)
                    except Exception as exc:  # memory may be half released: never score on it
                        guard.mark_broken(
                            f"going to sleep (level {level}) failed: {exc}; restart this replica"
                        )
                        raise ServerError(f"going to sleep (level {level}) failed: {exc}") from exc
                    guard.fall_asleep(level)
            except TimeoutError as exc:
                raise Unavailable(
                    f"scoring in flight did not finish within timeout_s={timeout_s:g}s; the replica stays "
                    "awake: retry"
                ) from exc
            seconds = time.monotonic() - start
        self.metrics.set_sleep_level(level)
        log.info("asleep at level %d after %.3fs (device bytes freed: %s)", level, seconds, freed)
        return self.answer(changed=True, seconds=seconds, freed=freed)

    async def wake(self, timeout_s: float, reload: bool = True) -> SleepResponse:
        guard = self.engine.guard
        async with self._one_at_a_time(timeout_s):
            if guard.state != "sleeping":
                return self.answer(changed=False)
            level = int(guard.sleep_level or 1)
            start = time.monotonic()
            # Nothing scores while asleep, so the lock is free at once.
            async with guard.updating(timeout_s=timeout_s, waking=True):
                try:
                    await self.engine.wake(level)
                except Exception as exc:
                    guard.mark_broken(f"waking from sleep level {level} failed: {exc}; restart this replica")
                    raise ServerError(f"waking from sleep level {level} failed: {exc}") from exc
                problem = None
                if level == 2:
                    problem = await self._reload() if reload else UNLOADED
                if problem is None:
                    if level == 1:
                        await self.weights.port.reset_cache()
                    guard.woke()
                else:
                    guard.mark_broken(problem, needs_full_push=True)
            seconds = time.monotonic() - start
        self.metrics.set_sleep_level(0)
        if problem is UNLOADED:
            log.info("awake after %.3fs (level 2, not reloaded): waiting for a full push", seconds)
        elif problem is not None:
            log.error(problem)
        else:
            log.info("awake after %.3fs (slept at level %d)", seconds, level)
        return self.answer(changed=True, seconds=seconds, detail=problem)

    async def _reload(self) -> str | None:
        """Rebuild the weights of the served version after a level-2 sleep; None when done, else why
        it could not be (with what to do)."""
        version = self.engine.guard.version
        manifest = set(self.weights.manifest)
        lost = f"the level-2 sleep discarded the weights of version {version}"
        saved: set[str] = set()
        if version > 0:
            try:
                store = await self.weights.restorable(version)
            except Conflict as exc:
                return f"{lost} and they cannot be rebuilt ({exc.message}); push the full weights again"
            except Exception as exc:
                return f"{lost} and reading the saved weights failed ({exc}); push the full weights again"
            saved = store.saved_names()
        port = self.weights.port
        if not manifest <= saved:  # the saved pushes do not cover everything: the base goes under them
            base = self.engine.base_checkpoint
            if base is None:
                return (
                    f"{lost}; the base weights were random (--load-format dummy) and cannot be read again: "
                    "push the full weights again"
                )
            try:
                loaded = await WorkerCalls(port).load_checkpoint(base)
            except Exception as exc:
                return f"{lost}; reloading the base checkpoint {base} failed ({exc}): push the full weights again"
            missing = manifest - set(loaded[0]) - saved
            if missing:
                return (
                    f"{lost}; the checkpoint {base} lacks {len(missing)} served parameter(s) "
                    f"(e.g. {sorted(missing)[:3]}): push the full weights again"
                )
        try:
            if version > 0:
                await self.weights.load_saved(version)
            else:
                await port.reset_cache()
        except Exception as exc:
            return f"{lost}; loading the saved weights failed ({exc}): push the full weights again"
        return None
