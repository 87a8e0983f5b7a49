"""The node agent: registers its Node (:mod:`.registration`), watches the Pods bound to it and
runs a :class:`PodWorker` for each; hands out the node's pod addresses and GPUs to the workers.

The watch re-lists every ``watch_timeout_s`` (and after any error, with a growing delay): a pod
that vanished from the list is gone, one that finished before the agent started never runs again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from rewardplane.localcluster.gpus import GpuInventory
from rewardplane.localcluster.nodeagent.config import API_TIMEOUT_S, AgentConfig
from rewardplane.localcluster.nodeagent.podworker import PodWorker
from rewardplane.localcluster.nodeagent.processes import kill_leftovers
from rewardplane.localcluster.nodeagent.registration import NodeRegistration
from rewardplane.localcluster.podspec import (
    IPAllocator,
    Objects,
    Pod,
    decode_secret_data,
    encode_configmap_data,
    referenced_objects,
)

log = logging.getLogger("rewardplane.nodeagent")


def _json(resp: Any) -> dict[str, Any]:
    return json.loads(resp.data)


class NodeAgent:
    """Registers the Node, heartbeats, watches its pods and runs a PodWorker for each."""

    def __init__(self, api_client: Any, cfg: AgentConfig) -> None:
        from kubernetes import client

        self.cfg = cfg
        self.core = client.CoreV1Api(api_client)
        self.stop_event = threading.Event()
        self._ips = IPAllocator(network=cfg.pod_network)
        self._gpus = GpuInventory(cfg.gpus)
        self._alloc_lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}
        self._workers_lock = threading.Lock()
        self._selector = f"spec.nodeName={cfg.node_name}"
        self.node = NodeRegistration(self.core, cfg, self.stop_event)

    # -- allocation (called from workers)
    def allocate_ip(self, uid: str, preferred: str | None) -> str:
        with self._alloc_lock:
            return self._ips.allocate(uid, preferred)

    def claim_gpus(self, uid: str, name: str, n: int) -> tuple[int, ...]:
        with self._alloc_lock:
            return self._gpus.claim_exclusive(uid, name, n)

    def pin_gpus(self, uid: str, name: str, devices: tuple[int, ...]) -> None:
        with self._alloc_lock:
            self._gpus.pin(uid, name, devices)

    def begin_gpu_start(self, uid: str, *, mark: bool) -> str | None:
        with self._alloc_lock:
            return self._gpus.begin_start(uid, mark=mark)

    def set_gpu_starting(self, uid: str, starting: bool) -> None:
        with self._alloc_lock:
            self._gpus.set_starting(uid, starting)

    def worker_done(self, worker: PodWorker) -> None:
        with self._alloc_lock:
            self._ips.release(worker.uid)
            self._gpus.release(worker.uid)
        with self._workers_lock:
            if self._workers.get(worker.uid) is worker:
                del self._workers[worker.uid]

    def read_refs(self, pod: Pod) -> tuple[Objects, Objects]:
        """The Secrets and ConfigMaps the pod references (absent ones are simply missing)."""
        ns = pod["metadata"].get("namespace", "default")
        secret_names, cm_names = referenced_objects(pod)
        secrets: dict[tuple[str, str], dict[str, bytes]] = {}
        configmaps: dict[tuple[str, str], dict[str, bytes]] = {}
        for name in secret_names:
            obj = self._read(self.core.read_namespaced_secret, name, ns)
            if obj is not None:
                secrets[(ns, name)] = {
                    **decode_secret_data(obj.get("data")),
                    **{k: v.encode() for k, v in (obj.get("stringData") or {}).items()},
                }
        for name in cm_names:
            obj = self._read(self.core.read_namespaced_config_map, name, ns)
            if obj is not None:
                configmaps[(ns, name)] = encode_configmap_data(obj.get("data"), obj.get("binaryData"))
        return secrets, configmaps

    @staticmethod
    def _read(fn: Any, name: str, ns: str) -> dict[str, Any] | None:
        try:
            return _json(fn(name, ns, _preload_content=False, _request_timeout=API_TIMEOUT_S))
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return None
            raise

    # -- lifecycle
    def run(self) -> None:
        """Block until ``stop()``; then stop every pod process (bounded) and mark the node down."""
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        n = kill_leftovers(self.cfg.agent_id)
        if n:
            log.warning("killed %d process group(s) left by an earlier agent for this node", n)
        self.node.register_until_ok()
        threads = [
            threading.Thread(target=self.node.heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._watch_loop, name="watch", daemon=True),
        ]
        for t in threads:
            t.start()
        log.info(
            "node %s registered (gpus=%d); watching pods with %s",
            self.cfg.node_name,
            self.cfg.gpus,
            self._selector,
        )
        self.stop_event.wait()
        self._shutdown()

    def stop(self) -> None:
        self.stop_event.set()

    def _shutdown(self) -> None:
        with self._workers_lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        deadline = time.monotonic() + self.cfg.max_grace_s + 15
        for w in workers:
            w.join(timeout=max(deadline - time.monotonic(), 0.1))
        self.node.mark_stopped()
        log.info("node agent stopped")

    # -- pods
    def _watch_loop(self) -> None:
        from kubernetes import watch

        delay = 0.5
        while not self.stop_event.is_set():
            try:
                rv = self._relist()
                w = watch.Watch()
                for event in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=self._selector,
                    resource_version=rv,
                    timeout_seconds=self.cfg.watch_timeout_s,
                    _request_timeout=(API_TIMEOUT_S, self.cfg.watch_timeout_s + API_TIMEOUT_S),
                    deserialize=False,
                ):
                    if self.stop_event.is_set():
                        w.stop()
                        break
                    self._on_event(event)
                delay = 0.5
            except Exception as exc:
                log.warning("pod watch failed (re-listing in %.1fs): %s", delay, exc)
                self.stop_event.wait(delay)
                delay = min(delay * 2, 10)

    def _relist(self) -> str:
        data = _json(
            self.core.list_pod_for_all_namespaces(
                field_selector=self._selector, _preload_content=False, _request_timeout=API_TIMEOUT_S
            )
        )
        live = set()
        for pod in data.get("items") or []:
            live.add(pod["metadata"]["uid"])
            self._on_pod(pod)
        with self._workers_lock:
            vanished = [w for uid, w in self._workers.items() if uid not in live]
        for w in vanished:
            w.gone()
        return str(data["metadata"]["resourceVersion"])

    def _on_event(self, event: dict[str, Any]) -> None:
        obj = event.get("raw_object") or event.get("object")
        if isinstance(obj, (bytes, str)):
            obj = json.loads(obj)
        if event.get("type") == "ERROR" or not isinstance(obj, dict) or obj.get("kind") == "Status":
            raise RuntimeError(f"watch error: {obj}")  # e.g. 410 Gone: re-list
        if event.get("type") == "DELETED":
            with self._workers_lock:
                w = self._workers.get(obj["metadata"]["uid"])
            if w:
                w.gone()
            return
        self._on_pod(obj)

    def _on_pod(self, pod: Pod) -> None:
        if self.stop_event.is_set():
            return
        uid = pod["metadata"]["uid"]
        with self._workers_lock:
            w = self._workers.get(uid)
            if w is not None:
                w.update(pod)
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                return  # finished before this agent started: never run again
            w = PodWorker(self, pod)
            self._workers[uid] = w
        w.start()
