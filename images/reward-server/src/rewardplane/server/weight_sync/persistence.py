"""Persisting pushed weights, so a restarted replica can be restored without the trainer.

After every successful update the server saves what was pushed (safetensors: the union of every
parameter pushed so far, latest value per name) and the version into ``--weights-dir``.
``POST /restore_weights {"version": N}`` loads that state and commits version N; the operator calls
it when a replica restarted onto base weights.

Cost: each update copies the pushed parameters to host memory under the update lock (a device →
host copy of the pushed bytes; scoring waits for it) and writes them to disk in a background thread
(disk I/O of the union of pushed parameters, e.g. the whole model for full pushes: ~2 bytes/param
in bf16). A head_only push after a full one rewrites the union (read + write). Disk space: one copy
of the union per replica.

Both engines do it the same way, in the worker extension, under the pushed (HF) names: every worker
of a replica saves what it keeps of each pushed tensor — the whole tensor, or, where a
tensor-parallel worker keeps one range of it (``copy_plan.py`` learned it from the loader), that
range with its place in the whole tensor. A replica of one worker writes ``pushed.safetensors`` and
``version.json``; worker ``k`` of ``n`` writes ``pushed.rank<k>-of-<n>.safetensors`` and
``version.rank<k>-of-<n>.json``, and the replica's saved version is the one all ``n`` agree on. So a
sliced push (each worker receives only its range) is saved as it arrived, and no worker holds or
writes the whole model. A restore goes through the engine's own ``load_weights`` in every worker,
one parameter at a time on the device: a range is put back into a tensor of the whole shape (the
rest zeros, which the worker's loader does not read), so neither costs GPU memory beyond one
parameter, within vLLM's memory fraction. Weights saved by a replica of another tensor-parallel
size (the RewardModel's size changed; the directory stays the Pod's) are put together into whole
tensors from all of that replica's workers and saved again at this size by the restore.

This module is the store; the control plane drives it (``control_state.ControlPlaneState.persist``, ``control_restore``)
and ``routes.persistence_router`` serves ``POST /restore_weights``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rewardplane.protocol.slices import Region
from rewardplane.server.weight_sync.copy_plan import region_of

log = logging.getLogger(__name__)


def base_fingerprint(manifest: Mapping[str, Any], params: Mapping[str, torch.Tensor] | None) -> str:
    """Identifies the base model a server loaded: every parameter's name, dtype and shape, plus a
    few values from each end of every parameter (cheap at any size, yet two checkpoints of one
    architecture differ). Saved weights carry it, and are never restored onto another base."""
    digest = hashlib.sha256()
    for name in sorted(manifest):
        meta = manifest[name]
        digest.update(f"{name}:{meta.dtype}:{tuple(meta.shape)};".encode())
        if params is not None and name in params:
            flat = params[name].detach().reshape(-1)
            sample = torch.cat([flat[:8], flat[-8:]]).to("cpu", torch.float64)
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class HostCopy:
    """What a worker keeps of one pushed tensor: all of it, or the range ``region`` of a tensor of
    ``shape`` (a tensor-parallel worker's rows or columns)."""

    tensor: torch.Tensor  # on the host
    region: Region | None = None
    shape: tuple[int, ...] = ()  # the whole pushed tensor's shape (with a region)

    @classmethod
    def taken(cls, part: torch.Tensor, region: Region | None, shape: Any) -> HostCopy:
        """A host copy of ``part`` (on any device), the ``region`` of a tensor of ``shape``."""
        return cls(part.detach().to("cpu", copy=True), region, tuple(shape))

    def whole(self, device: torch.device) -> torch.Tensor:
        """The tensor to give the loader on ``device``: this copy, or, for a range, a tensor of the
        whole shape holding it (the rest zeros: the worker that kept the range reads only it)."""
        if self.region is None:
            return self.tensor.to(device)
        out = torch.zeros(self.shape, dtype=self.tensor.dtype, device=device)
        region_of(out, self.region).copy_(self.tensor)
        return out


_RANK_FILE = re.compile(r"^version\.rank(\d+)-of-(\d+)\.json$")


@dataclass
class Saved:
    """A worker's saved weights: the version, its copies, and whether they were saved by a replica
    of another tensor-parallel size (then every copy is a whole tensor, put together from all of
    that replica's workers, and this worker's own union must start from them)."""

    version: int
    copies: dict[str, HostCopy]
    other_size: bool = False


class WeightsStore:
    """The persisted union of pushed parameters in one directory (atomic file replacement), as
    worker ``rank`` of a replica of ``ranks`` workers sees it (the control plane: any rank).

    Weights saved at another tensor-parallel size (the RewardModel's size changed; the directory
    stays the Pod's) are read when they are the latest: whole tensors are put together from the
    ranges of all that size's workers, and the restore saves them at this size in place of what
    this size saved before."""

    def __init__(self, directory: Path, base: str = "", rank: int = 0, ranks: int = 1) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = base  # base_fingerprint of the model these weights were pushed onto
        self.rank = rank
        self.ranks = ranks  # the replica's workers (tensor-parallel size); set before anything is read
        self._lock = threading.Lock()

    def _weights(self, rank: int, size: int) -> Path:
        return self.dir / f"pushed{_suffix(rank, size)}.safetensors"

    def _record(self, rank: int, size: int) -> Path:
        return self.dir / f"version{_suffix(rank, size)}.json"

    def _saved(self, rank: int, size: int) -> dict[str, Any]:
        try:
            saved = json.loads(self._record(rank, size).read_text())
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def _versions(self, size: int) -> list[int | None]:
        """Each worker's saved version at ``size`` workers (None: nothing readable)."""
        out: list[int | None] = []
        for rank in range(size):
            try:
                out.append(int(self._saved(rank, size)["version"]))
            except (KeyError, TypeError, ValueError):
                out.append(None)
        return out

    def _agreed(self, size: int) -> int | None:
        versions = self._versions(size)
        first = versions[0]
        return first if first is not None and all(v == first for v in versions) else None

    def _sizes(self) -> list[int]:
        """The replica sizes that saved anything here."""
        sizes = {
            int(m.group(2))
            for p in self.dir.glob("version.rank*-of-*.json")
            if (m := _RANK_FILE.match(p.name))
        }
        if (self.dir / "version.json").exists():
            sizes.add(1)
        return sorted(sizes)

    def _latest(self) -> tuple[int, int] | None:
        """(version, replica size) of the saved weights that count: of the sizes whose workers all
        agree, the one with the latest version (this size on a tie: a restore from another size
        saved it)."""
        agreed = [(v, n == self.ranks, n) for n in self._sizes() if (v := self._agreed(n)) is not None]
        if not agreed:
            return None
        version, _, size = max(agreed)
        return version, size

    def saved_version(self) -> int | None:
        """The version every worker of the saving replica saved, or None (nothing saved, or the
        workers disagree: ``unsaved_reason`` says which)."""
        latest = self._latest()
        return None if latest is None else latest[0]

    def unsaved_reason(self) -> str:
        """Why ``saved_version`` is None, in words."""
        for size in [self.ranks, *(n for n in self._sizes() if n != self.ranks)]:
            versions = self._versions(size)
            if any(v is not None for v in versions):
                found = ", ".join(
                    f"worker {k}: {v if v is not None else 'nothing'}" for k, v in enumerate(versions)
                )
                return (
                    f"the {size} worker(s) that saved the weights in {self.dir} saved different versions "
                    f"({found}): a save failed part-way"
                )
        return f"nothing was pushed to this replica's directory {self.dir} yet"

    def saved_base(self) -> str | None:
        latest = self._latest()
        base = self._saved(0, latest[1]).get("base") if latest is not None else None
        return str(base) if base else None

    def save(self, version: int, copies: Mapping[str, HostCopy], *, replace: bool = False) -> None:
        """Merge this worker's ``copies`` into its saved union (``replace``: they are the whole
        union) and record ``version`` (latest value per name). The record follows the weights, so
        it never names absent weights."""
        from safetensors.torch import save_file

        with self._lock:
            union, regions = ({}, {}) if replace else _read(self._weights(self.rank, self.ranks))
            for name, copy in copies.items():
                union[name] = copy.tensor.contiguous()
                if copy.region is None:
                    regions.pop(name, None)
                else:
                    r = copy.region
                    regions[name] = [r.dim, r.start, r.stop, list(copy.shape)]
            path = self._weights(self.rank, self.ranks)
            tmp = path.with_name(path.name + ".tmp")
            metadata = {"version": str(version), "rank": str(self.rank), "ranks": str(self.ranks)}
            if regions:
                metadata["regions"] = json.dumps(regions)
            save_file(union, str(tmp), metadata=metadata)
            os.replace(tmp, path)
            record = self._record(self.rank, self.ranks)
            tmp_record = record.with_name(record.name + ".tmp")
            tmp_record.write_text(
                json.dumps({"version": version, "parameters": len(union), "base": self.base})
            )
            os.replace(tmp_record, record)

    def saved_names(self) -> set[str]:
        """The names every worker of the saving replica saved (read from the files' headers; no
        tensor is loaded)."""
        from safetensors import safe_open

        latest = self._latest()
        if latest is None:
            return set()
        size = latest[1]
        names: set[str] | None = None
        with self._lock:
            for rank in range(size):
                path = self._weights(rank, size)
                if not path.exists():
                    return set()
                with safe_open(str(path), framework="pt") as f:
                    keys = set(f.keys())
                names = keys if names is None else names & keys
        return names or set()

    def load(self) -> Saved | None:
        """What this worker restores, or None when nothing was saved."""
        with self._lock:
            latest = self._latest()
            if latest is None:
                return None
            version, size = latest
            if size == self.ranks:
                path = self._weights(self.rank, size)
                if not path.exists():
                    return None
                tensors, regions = _read(path)
                return Saved(version, _copies(tensors, regions))
            parts = [_read(self._weights(rank, size)) for rank in range(size)]
        return Saved(version, _assembled(parts), other_size=True)


def _suffix(rank: int, size: int) -> str:
    return "" if size == 1 else f".rank{rank}-of-{size}"


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """A saved file's tensors and the ranges among them (name → dim, start, stop, whole shape)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.exists():
        return {}, {}
    with safe_open(str(path), framework="pt") as f:
        regions = json.loads((f.metadata() or {}).get("regions", "{}"))
    return load_file(str(path)), regions


def _copies(tensors: dict[str, torch.Tensor], regions: dict[str, list[Any]]) -> dict[str, HostCopy]:
    copies = {}
    for name, tensor in tensors.items():
        if name in regions:
            dim, start, stop, shape = regions[name]
            copies[name] = HostCopy(tensor, Region(dim, start, stop), tuple(shape))
        else:
            copies[name] = HostCopy(tensor)
    return copies


def _assembled(parts: list[tuple[dict[str, torch.Tensor], dict[str, list[Any]]]]) -> dict[str, HostCopy]:
    """Whole tensors from every worker's saved ranges (a name saved whole comes from the first)."""
    names = set(parts[0][0])
    for tensors, _ in parts[1:]:
        names &= set(tensors)
    out: dict[str, HostCopy] = {}
    for name in sorted(names):
        if any(name not in regions for _, regions in parts):  # replicated: every worker has it whole
            out[name] = HostCopy(next(t[name] for t, regions in parts if name not in regions))
            continue
        dim, _, _, shape = parts[0][1][name]
        whole = torch.empty(shape, dtype=parts[0][0][name].dtype)
        covered = torch.zeros(shape[dim], dtype=torch.bool)
        for tensors, regions in parts:
            _, start, stop, _ = regions[name]
            region_of(whole, Region(dim, start, stop)).copy_(tensors[name])
            covered[start:stop] = True
        if not bool(covered.all()):
            raise LookupError(
                f"the saved ranges of {name} do not cover the whole tensor; push the weights again"
            )
        out[name] = HostCopy(whole)
    return out


PERSIST_WAIT_S = 3600.0  # bound on one background write (the union of a large model, on a slow disk)
