"""Peer restore, the sending side: this replica's live weights broadcast to a restarted one."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from rewardplane.protocol import ParamMeta, SendWeightsRequest
from rewardplane.server.weight_sync.worker.state import WorkerHost
from rewardplane.transport.buckets import torch_dtype
from rewardplane.transport.comm import create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.transfer import send_buckets

log = logging.getLogger(__name__)


class PeerSender:
    """Reading the live weights back under their pushed names (``WorkerHost.peer_view``), and
    sending them on a thread."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        self._thread: threading.Thread | None = None
        self._outcome: tuple[bool, str] | None = None  # (succeeded, detail) of the last send

    def problem(self, names: list[str]) -> str | None:
        """Why this worker cannot send ``names`` to a peer now, or None."""
        missing = [n for n in names if self.host.peer_view(n) is None]
        if not missing:
            return None
        why = "they were not pushed to this replica since it started, or its loader transforms them"
        return f"{len(missing)} of {len(names)} parameters cannot be read back under their pushed names ({why}): e.g. {missing[:3]}"

    def start(self, metadata: list[dict[str, Any]], send: SendWeightsRequest) -> None:
        """Host the group's rendezvous on ``send.port``, take the last rank of its
        ``send.world_size`` and broadcast ``metadata``'s tensors as a full push, on a thread of its
        own (vLLM's engine loop, and scoring, go on meanwhile); ``outcome`` tells how it ended."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("this worker is sending its weights to peers already")
        metas = [ParamMeta(**m) for m in metadata]
        device = self.host.device()
        tensors: dict[str, torch.Tensor] = {}
        for meta in metas:
            view = self.host.peer_view(meta.name)
            if view is None:
                raise LookupError(f"{meta.name} cannot be read back (the send problem says why)")
            # the wire carries the manifest's dtype (an fp32 head pushed as bf16 goes back as bf16)
            want = torch_dtype(meta.dtype)
            tensors[meta.name] = (
                view if view.dtype == want and view.is_contiguous() else view.to(want).contiguous()
            )
        self._outcome = None
        port, world_size, timeout_s = send.port, send.world_size, send.timeout_s

        def run() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the device is per thread
            rank = world_size - 1
            try:
                store = create_store(
                    "0.0.0.0", port, is_master=True, world_size=world_size, timeout_s=timeout_s
                )
                comm = open_group(
                    store,
                    rank=rank,
                    world_size=world_size,
                    device=device,
                    timeout_s=timeout_s,
                    group_id=send.group,
                )
                try:
                    with torch.no_grad():
                        sent = send_buckets(comm, metas, tensors, send.bucket_bytes, src=rank)
                    failed = comm.max_flag(0)  # the receivers commit only once every rank agrees
                except BaseException:
                    comm.abort()  # the receivers see the group fail at once instead of waiting it out
                    raise
                comm.close()
                self._outcome = (
                    (False, "a receiver reported a failure")
                    if failed
                    else (True, f"{sent} bytes to {rank} rank(s)")
                )
            except Exception as e:  # reported through outcome(); this replica only read
                log.exception("sending the weights to peers failed")
                self._outcome = (False, f"{type(e).__name__}: {e}")

        self._thread = threading.Thread(target=run, name="rp-peer-send", daemon=True)
        self._thread.start()

    def outcome(self) -> tuple[bool, str] | None:
        """(succeeded, what happened) once the send started last has ended; None while it runs."""
        if self._thread is not None and self._thread.is_alive():
            return None
        return self._outcome or (False, "no send was started")
