"""Bringing stale replicas back to the model's weights version: from saved weights first
(``persistDir``, or the Pod's own copy after a container restart), else a healthy peer sends them
over the data plane. What to do is decided by :func:`.recovery.restore_plan`; this module makes the
calls, posts the Events and remembers what is under way.

A disk restore runs inline; a replica whose disk restore failed goes to a peer on the next pass.
One peer restore of a model runs at a time: its source sends to every receiver at once and would
refuse a second send (409) until the first is done. It runs in the background; a watcher
reconciles the model the moment the receivers serve the version (or the restore ends otherwise),
so they are admitted, and the next restore starts, at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from rewardplane.api.names import ANNOTATION_GROUP_PORT
from rewardplane.protocol import RestoreWeightsRequest

from . import metrics
from .cluster import Key
from .pods import pod_restarts
from .recovery import Identity, ReplicaView, identity, restore_plan
from .replicas import Receiver, ReplicaError, Replicas, restore_from_peer
from .status import Event, restore_failed_message

log = logging.getLogger("rewardplane.operator")

RESTORE_TIMEOUT_S = 300.0  # loading saved weights from disk, or receiving them from a peer
PEER_RETRY_S = 5.0  # after a peer restore could not start (the source was busy, a call failed)

Later = Callable[[float, Callable[[], None]], None]  # run the work after a delay (s): a timer


class Restorer:
    def __init__(
        self,
        replicas: Replicas,
        *,
        token: Callable[[str, str], str],
        post_event: Callable[[Mapping[str, Any], Event], None],
        request: Callable[[Key, str], None],
        later: Later,
    ) -> None:
        self.replicas = replicas
        self.token = token  # (namespace, model) → the model's control-plane token
        self.post_event = post_event
        self.request = request  # reconcile a model again
        self.later = later  # run work in the background
        self._guard = threading.Lock()
        self._restore_failed: dict[Key, Identity] = {}  # (ns, pod) → identity a disk restore failed for
        # (ns, pod) → (identity, monotonic deadline) of a peer restore in flight (or its retry delay)
        self._restoring: dict[Key, tuple[Identity, float]] = {}
        self._unrecoverable_told: dict[Key, Identity] = {}

    def restore(self, view: ReplicaView) -> tuple[bool, tuple[str, ...]]:
        """Bring the view's stale replicas to its target version.

        Returns (whether to look again at once: a replica was restored from disk, or a disk restore
        failed and a peer is next; the replicas nothing can restore: their weights are lost).
        """
        ns, _ = view.key
        by_name = view.by_name
        now = time.monotonic()
        with self._guard:
            busy = {
                pod
                for (pns, pod), (ident, until) in self._restoring.items()
                if pns == ns and pod in by_name and ident == identity(by_name[pod]) and until > now
            }
        disk_failed = {
            pod
            for pod in view.stale
            if pod in by_name and self._restore_failed.get((ns, pod)) == identity(by_name[pod])
        }
        persist_dir = view.plan.spec.weight_sync.persist_dir
        pod_copies = (
            {n for n in view.stale if n in by_name and pod_restarts(by_name[n]) > 0}
            if view.plan.spec.weight_sync.pod_copy and not persist_dir
            else set()
        )
        todo = restore_plan(
            view.stale,
            view.probes,
            view.target,
            persisted=bool(persist_dir),
            disk_failed=disk_failed,
            busy=busy,
            pod_copies=pod_copies,
        )
        if not (todo.from_disk or todo.from_peer or todo.unrecoverable):
            return False, ()
        token = self.token(*view.key)
        restored = self._from_disk(view, todo.from_disk, token)
        if todo.peer_source is not None and todo.from_peer and not busy:
            self._from_peer(view, todo.peer_source, todo.from_peer, token, now)
        self._tell_unrecoverable(view, todo.unrecoverable)
        return restored, todo.unrecoverable

    def _from_disk(self, view: ReplicaView, pods: tuple[str, ...], token: str) -> bool:
        """Restore ``pods`` from their saved weights; True when any was tried (restored, or failed
        so that a peer is next)."""
        ns, target = view.key[0], view.target
        persist_dir = view.plan.spec.weight_sync.persist_dir
        for pod_name in pods:
            pod = view.by_name[pod_name]
            try:
                self.replicas.restore_weights(
                    view.url(pod), token, RestoreWeightsRequest(version=target, timeout_s=RESTORE_TIMEOUT_S)
                )
            except ReplicaError as exc:
                self._restore_failed[(ns, pod_name)] = identity(pod)
                message = restore_failed_message(pod_name, target, str(exc), persist_dir)
                self.post_event(view.rm, Event("Warning", "RestoreFailed", message))
                continue
            metrics.POD_ACTIONS.labels(action="restore").inc()
            message = f"{pod_name} restored to weights version {target} from saved weights"
            self.post_event(view.rm, Event("Normal", "ReplicaRestored", message))
        return bool(pods)

    def _from_peer(
        self, view: ReplicaView, source_name: str, pods: tuple[str, ...], token: str, now: float
    ) -> None:
        """Start ``source_name`` sending the target version to ``pods``; a watcher follows it."""
        ns, name = view.key
        target = view.target
        source = view.by_name[source_name]
        receivers = [view.by_name[p] for p in pods]
        try:
            restore_from_peer(
                self.replicas,
                token,
                source_url=view.url(source),
                source_host=source["status"]["podIP"],
                port=int(source["metadata"]["annotations"][ANNOTATION_GROUP_PORT]),
                receivers=[
                    Receiver(p["metadata"]["name"], view.url(p), view.plan.spec.tensor_parallel_size)
                    for p in receivers
                ],
                version=target,
                timeout_s=RESTORE_TIMEOUT_S,
                group_id=f"{name}-peer-v{target}-{uuid.uuid4().hex[:6]}",
            )
        except ReplicaError as exc:
            for p in receivers:
                self._restoring[(ns, p["metadata"]["name"])] = (identity(p), now + PEER_RETRY_S)
            message = (
                f"copying weights version {target} from {source_name} to {', '.join(pods)} "
                f"failed: {exc}; retried in {PEER_RETRY_S:.0f}s (a full push also repairs them)"
            )
            self.post_event(view.rm, Event("Warning", "RestoreFailed", message))
            return
        with self._guard:
            for p in receivers:
                self._restoring[(ns, p["metadata"]["name"])] = (identity(p), now + RESTORE_TIMEOUT_S)
        metrics.POD_ACTIONS.labels(action="peer-restore").inc()
        self._watch_peer_restore(view.key, {p["metadata"]["name"]: view.url(p) for p in receivers}, target)
        message = f"{source_name} sends weights version {target} to {', '.join(pods)}"
        self.post_event(view.rm, Event("Normal", "ReplicaRestoring", message))

    def _watch_peer_restore(self, key: Key, receivers: dict[str, str], target: int) -> None:
        """Reconcile the moment the receivers (pod → URL) of a peer restore serve ``target`` (or it
        ends otherwise)."""

        def watch() -> None:
            for url in receivers.values():
                try:
                    self.replicas.wait_for_version(url, target, RESTORE_TIMEOUT_S)
                except ReplicaError as exc:
                    log.info("%s/%s: following a peer restore at %s: %s", *key, url, exc)
            with self._guard:
                for pod in receivers:
                    self._restoring.pop((key[0], pod), None)
            self.request(key, "restored")

        self.later(0.0, watch)

    def _tell_unrecoverable(self, view: ReplicaView, pods: tuple[str, ...]) -> None:
        """An Event per replica start that nothing can restore; the status keeps saying it."""
        ns = view.key[0]
        for pod_name in pods:
            ident = identity(view.by_name[pod_name])
            if self._unrecoverable_told.get((ns, pod_name)) == ident:
                continue
            self._unrecoverable_told[(ns, pod_name)] = ident
            message = restore_failed_message(
                pod_name,
                view.target,
                "no healthy replica serves that version to copy it from",
                view.plan.spec.weight_sync.persist_dir,
            )
            self.post_event(view.rm, Event("Warning", "RestoreFailed", message))
