"""Restoring saved weights (``--weights-dir``) and reading back what every worker holds."""

from __future__ import annotations

import logging
from typing import Any

from rewardplane.server.errors import Conflict, Unavailable
from rewardplane.server.weight_sync.control_state import ControlPlaneState
from rewardplane.server.weight_sync.persistence import WeightsStore

log = logging.getLogger(__name__)


class Restores:
    """Restores from the replica's saved weights, and the parameters' checksums."""

    def __init__(self, state: ControlPlaneState) -> None:
        self.state = state

    async def restore(self, version: int, timeout_s: float) -> int:
        """Load the persisted state for ``version`` in every worker (through the engine's own loader,
        one parameter at a time on the device) and commit it; returns the parameters restored."""
        if self.state.busy():
            raise Conflict("a weight update is in progress; restore after it finishes")
        if (refusal := self.state.guard.write_refusal()) is not None:
            raise Conflict(refusal)
        store = await self.restorable(version)
        assert store is not None
        guard = self.state.guard
        try:
            async with guard.updating(timeout_s=timeout_s):
                try:
                    count = await self.load_saved(version)
                except Exception as exc:  # some parameters may be loaded: never serve a mix
                    if not isinstance(exc, Conflict):
                        guard.mark_broken(f"restoring version {version} failed part-way: {exc}")
                    raise
                guard.commit(version, pushed=False)  # a delta push never builds on a restore
        except TimeoutError as exc:
            raise Unavailable(
                f"scoring in flight did not finish within timeout_s={timeout_s:g}s; nothing was restored: retry"
            ) from exc
        self.state.metrics.weights_version.set(guard.version)
        log.info("restored persisted weights version %d (%d parameters)", version, count)
        return count

    async def restorable(self, version: int) -> WeightsStore:
        """The store, once it is sure to hold ``version`` saved onto this base model (else 409 with
        what to do)."""
        store = self.state.store
        if store is None:
            raise Conflict(
                "this server persists no weights: start it with --weights-dir (RewardModel "
                "spec.weightSync.persistDir) to make restores possible"
            )
        await self.state.prepare_workers()
        saved = store.saved_version()
        if saved is None:
            raise Conflict(
                f"no persisted weights to restore: {store.unsaved_reason()}; push the weights again"
            )
        if store.saved_base() != store.base:
            raise Conflict(
                f"the weights saved in {store.dir} were pushed onto another base model (fingerprint "
                f"{store.saved_base() or 'missing'}, this server loaded {store.base}); they are not restored "
                "onto this one: push the weights again"
            )
        if saved != version:
            raise Conflict(
                f"the persisted weights are version {saved}, not {version}; push version {version} again"
            )
        return store

    async def load_saved(self, version: int) -> int:
        """Inside the exclusive lock: load the saved union of ``version`` in every worker and drop
        what the engine cached; the parameters restored (the caller commits)."""
        try:
            counts = await self.state.calls.restore(version)
        except LookupError as exc:  # the store changed between the check and the load
            raise Conflict(f"{exc}; push version {version} again") from exc
        await self.state.port.reset_cache()
        return int(max(counts, default=0))

    async def param_checksums(self) -> tuple[int, list[Any]]:
        """The SHA-256 of every live parameter on every worker, and the version they are (hashed under
        the scoring side of the lock: no update runs meanwhile)."""
        async with self.state.guard.scoring() as version:
            workers = await self.state.calls.param_checksums()
        return version, workers
