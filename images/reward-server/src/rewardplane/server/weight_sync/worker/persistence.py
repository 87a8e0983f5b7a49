"""Keeping pushed weights on disk (the server's ``--weights-dir``), restoring them after a restart,
and loading the base checkpoint again after a level-2 sleep."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from rewardplane.protocol import ParamMeta
from rewardplane.protocol.slices import Region
from rewardplane.server.engines.checkpoint import iter_checkpoint
from rewardplane.server.weight_sync.copy_plan import region_of
from rewardplane.server.weight_sync.persistence import HostCopy, WeightsStore
from rewardplane.server.weight_sync.worker.base import WorkerBase

log = logging.getLogger(__name__)


class PersistencePart(WorkerBase):
    """Host copies of what a push loaded, written in the background; restore and checkpoint reload."""

    def rp_persist_to(self, directory: str, base: str = "", ranks: int = 1) -> None:
        """From now on keep host copies of loaded weights and persist them into ``directory``;
        ``base`` is the fingerprint of the base model they are pushed onto (saved with them),
        ``ranks`` the replica's workers (each saves its own part)."""
        self._rp_store = WeightsStore(Path(directory), base, rank=self.rp_local_rank(), ranks=ranks)

    def _rp_keeps(self) -> bool:
        return self._rp_store is not None

    def _rp_load_kept(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load, then copy to host what this worker keeps of each tensor (the tensors are views of a
        bucket reused next): the range a tensor-parallel worker keeps, once the loader showed it."""
        self.rp_load(weights)
        kept = self._rp_kept
        if kept is not None:
            with torch.no_grad():
                for name, tensor in weights:
                    found = self._rp_slice_of(name)
                    region = found[0] if found is not None else None
                    kept[name] = HostCopy.taken(region_of(tensor, region), region, tensor.shape)

    def _rp_keep_received(
        self, metas: list[ParamMeta], regions: list[Region | None], received: list[torch.Tensor]
    ) -> None:
        """Host copies of a sliced push's ranges, as received (into the parameters or staged)."""
        kept = self._rp_kept
        if kept is None:
            return
        with torch.no_grad():
            for meta, region, tensor in zip(metas, regions, received, strict=True):
                kept[meta.name] = HostCopy.taken(tensor, region, meta.shape)

    def rp_persist(self, version: int) -> bool:
        """Write this update's host copies into the store's union, in a background thread (disk I/O
        stays off the engine's loop). Returns whether this worker writes (every worker that
        persists)."""
        kept, self._rp_kept = self._rp_kept, None
        store = self._rp_store
        if store is None or kept is None or not self._rp_keeps():
            return False
        previous = self._rp_writer

        def write() -> None:
            if previous is not None:
                previous.join()  # versions land in order
            try:
                store.save(version, kept)
                log.info("persisted version %d (%d parameters) in %s", version, len(kept), store.dir)
            except Exception:
                log.exception("persisting version %d failed; a restart cannot be restored to it", version)

        self._rp_writer = threading.Thread(target=write, name=f"rp-persist-v{version}", daemon=True)
        self._rp_writer.start()
        return True

    def rp_persist_pending(self) -> bool:
        return self._rp_writer is not None and self._rp_writer.is_alive()

    def rp_restore(self, version: int) -> int:
        """Load this worker's persisted union of ``version`` through the engine's own loader (HF
        names; a saved range goes back inside a tensor of the whole shape, which the loader narrows
        to that range again). Weights saved at another tensor-parallel size come whole, and what
        this worker keeps of them replaces what it saved at its own size: its union starts from them.
        Returns the number of parameters restored.

        Raises ``LookupError`` naming the version found when it is not ``version``."""
        store = self._rp_store
        if store is None:
            raise LookupError("this worker persists no weights (no --weights-dir)")
        saved = store.load()
        if saved is None:
            raise LookupError(f"no persisted weights in {store.dir} for worker {store.rank} of {store.ranks}")
        if saved.version != version:
            raise LookupError(f"the persisted weights are version {saved.version}, not {version}")
        device = self.rp_device()
        self._rp_kept = {} if saved.other_size else None
        with torch.no_grad():
            # one tensor at a time on the device: restoring needs no more memory than one parameter
            for name, copy in saved.copies.items():
                self._rp_load_kept([(name, copy.whole(device))])
        kept, self._rp_kept = self._rp_kept, None
        if kept is not None:  # this size's union is now what was restored, nothing older
            store.save(version, kept, replace=True)
        return len(saved.copies)

    def rp_load_checkpoint(self, model_dir: str) -> list[str]:
        """Load the base checkpoint's weights again (after a level-2 sleep discarded them), one tensor
        at a time through the engine's own loader; the names loaded."""
        loaded: list[str] = []
        device = self.rp_device()
        self._rp_forget_places()  # the weights were discarded: learn their places again
        with torch.no_grad():
            for name, tensor in iter_checkpoint(Path(model_dir)):
                if self.rp_accepts(name):
                    self.rp_load([(name, tensor.to(device))])
                    loaded.append(name)
        if not loaded:
            raise LookupError(f"no safetensors weights found in {model_dir}")
        return loaded

    def rp_accepts(self, name: str) -> bool:
        """Whether ``rp_load`` takes a checkpoint tensor of this name (vLLM's loader skips what it
        does not use by itself)."""
        return True
