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
from rewardplane.server.weight_sync.worker.state import WorkerState

log = logging.getLogger(__name__)


class Persistence:
    """Host copies of what a push loaded (``state.kept``), written in the background; restore and
    checkpoint reload."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.store: WeightsStore | None = None
        self._writer: threading.Thread | None = None

    def persist_to(self, directory: str, base: str = "", ranks: int = 1) -> None:
        """From now on keep host copies of loaded weights and persist them into ``directory``;
        ``base`` is the fingerprint of the base model they are pushed onto (saved with them),
        ``ranks`` the replica's workers (each saves its own part)."""
        self.store = WeightsStore(Path(directory), base, rank=self.state.host.local_rank(), ranks=ranks)

    def keeps(self) -> bool:
        return self.store is not None

    def start_keeping(self, keep: bool = True) -> None:
        """Before an update is loaded: keep host copies of it (where this worker persists)."""
        self.state.kept = {} if keep and self.keeps() else None

    def load_kept(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load, then copy to host what this worker keeps of each tensor (the tensors are views of a
        bucket reused next): the range a tensor-parallel worker keeps, once the loader showed it."""
        host = self.state.host
        host.load(weights)
        kept = self.state.kept
        if kept is not None:
            with torch.no_grad():
                for name, tensor in weights:
                    found = host.slice_of(name)
                    region = found[0] if found is not None else None
                    kept[name] = HostCopy.taken(region_of(tensor, region), region, tensor.shape)

    def keep_received(
        self, metas: list[ParamMeta], regions: list[Region | None], received: list[torch.Tensor]
    ) -> None:
        """Host copies of a sliced push's ranges, as received (into the parameters or staged)."""
        kept = self.state.kept
        if kept is None:
            return
        with torch.no_grad():
            for meta, region, tensor in zip(metas, regions, received, strict=True):
                kept[meta.name] = HostCopy.taken(tensor, region, meta.shape)

    def persist(self, version: int) -> bool:
        """Write this update's host copies into the store's union, in a background thread (disk I/O
        stays off the engine's loop). Returns whether this worker writes (every worker that
        persists)."""
        kept, self.state.kept = self.state.kept, None
        store = self.store
        if store is None or kept is None:
            return False
        previous = self._writer

        def write() -> None:
            if previous is not None:
                previous.join()  # versions land in order
            try:
                store.save(version, kept)
                log.info("persisted version %d (%d parameters) in %s", version, len(kept), store.dir)
            except Exception:
                log.exception("persisting version %d failed; a restart cannot be restored to it", version)

        self._writer = threading.Thread(target=write, name=f"rp-persist-v{version}", daemon=True)
        self._writer.start()
        return True

    def pending(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def restore(self, version: int) -> int:
        """Load this worker's persisted union of ``version`` through the engine's own loader (HF
        names; a saved range goes back inside a tensor of the whole shape, which the loader narrows
        to that range again). Weights saved at another tensor-parallel size come whole, and what
        this worker keeps of them replaces what it saved at its own size: its union starts from them.
        Returns the number of parameters restored.

        Raises ``LookupError`` naming the version found when it is not ``version``."""
        store = self.store
        if store is None:
            raise LookupError("this worker persists no weights (no --weights-dir)")
        saved = store.load()
        if saved is None:
            raise LookupError(f"no persisted weights in {store.dir} for worker {store.rank} of {store.ranks}")
        if saved.version != version:
            raise LookupError(f"the persisted weights are version {saved.version}, not {version}")
        device = self.state.host.device()
        self.state.kept = {} if saved.other_size else None
        with torch.no_grad():
            # one tensor at a time on the device: restoring needs no more memory than one parameter
            for name, copy in saved.copies.items():
                self.load_kept([(name, copy.whole(device))])
        kept, self.state.kept = self.state.kept, None
        if kept is not None:  # this size's union is now what was restored, nothing older
            store.save(version, kept, replace=True)
        return len(saved.copies)


def load_checkpoint(state: WorkerState, model_dir: str) -> list[str]:
    """Load the base checkpoint's weights again (after a level-2 sleep discarded them; the caller
    forgets their places first), one tensor at a time through the engine's own loader; the names
    loaded."""
    host = state.host
    loaded: list[str] = []
    device = host.device()
    with torch.no_grad():
        for name, tensor in iter_checkpoint(Path(model_dir)):
            if host.accepts(name):
                host.load([(name, tensor.to(device))])
                loaded.append(name)
    if not loaded:
        raise LookupError(f"no safetensors weights found in {model_dir}")
    return loaded
