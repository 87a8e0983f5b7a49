"""Retiring a deleted RewardModel before its finalizer is removed, so that an object created again
under the same name starts clean: its Pods are gone (no old replica answers with the old weights
version), and the weights it persisted under ``persistDir`` are removed from every node.

Pure: the wipe Pod (one per node), and the wait's verdict. The I/O is :class:`Retirement`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewardplane.api.kube import Kube, KubeError, core_path
from rewardplane.api.names import LABEL_COMPONENT, LABEL_MANAGED_BY

from .render import selector

log = logging.getLogger("rewardplane.operator")

WIPE_COMPONENT = "weights-wipe"
WIPE_MOUNT = "/persisted"
# A replica drains for up to the Pod's grace period (30 s): the wait for the Pods is a little longer.
PODS_GONE_TIMEOUT_S = 45.0
WIPE_TIMEOUT_S = 60.0
POLL_S = 0.5


def model_image(rm: Mapping[str, Any], default_image: str | None) -> str | None:
    return str(((rm.get("spec") or {}).get("engine") or {}).get("image") or default_image or "") or None


def wipe_pod_name(model: str, uid: str, node: str) -> str:
    # a Pod name is at most 253 characters and a node name can be long: a digest of it names the Pod
    return f"{model[:40]}-wipe-{uid[:8]}-{hashlib.sha256(node.encode()).hexdigest()[:8]}"


def wipe_pod(rm: Mapping[str, Any], node: str, image: str, persist_dir: str) -> dict[str, Any]:
    """A Pod on ``node`` that removes ``<persistDir>/<uid>``: the deleted object's persisted weights
    (``render.weights_dir``). Root, no capabilities: the server that wrote them ran as root."""
    meta, spec = rm["metadata"], rm.get("spec") or {}
    target = f"{WIPE_MOUNT}/{meta['uid']}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": wipe_pod_name(meta["name"], meta["uid"], node),
            "namespace": meta["namespace"],
            "labels": {LABEL_COMPONENT: WIPE_COMPONENT, LABEL_MANAGED_BY: "rewardplane"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": int(WIPE_TIMEOUT_S),
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "wipe",
                    "image": image,
                    "imagePullPolicy": (spec.get("engine") or {}).get("imagePullPolicy") or "IfNotPresent",
                    "command": ["/bin/sh", "-c", 'rm -rf -- "$0"', target],
                    "volumeMounts": [{"name": "persisted", "mountPath": WIPE_MOUNT}],
                    "securityContext": {
                        "runAsUser": 0,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [
                {"name": "persisted", "hostPath": {"path": persist_dir, "type": "DirectoryOrCreate"}}
            ],
        },
    }


def wipe_finished(pod: Mapping[str, Any] | None) -> bool:
    return pod is None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class Retirement:
    """Deletes a model's Pods and waits until they are gone, then wipes its persisted weights."""

    def __init__(
        self,
        kube: Kube,
        nodes: Callable[[], Sequence[str]],
        default_image: str | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kube = kube
        self.nodes = nodes
        self.default_image = default_image
        self._clock, self._sleep = clock, sleep

    def _wait(self, what: str, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        while not done():
            if self._clock() > deadline:
                log.warning("%s: not done within %.0f s; going on", what, timeout_s)
                return False
            self._sleep(POLL_S)
        return True

    def pods_gone(self, rm: Mapping[str, Any]) -> bool:
        """Delete the model's Pods (they drain as on any delete) and wait until none is left."""
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        path = core_path("pods", ns)
        for pod in self.kube.list(path, label_selector=selector(name)):
            self.kube.delete(core_path("pods", ns, pod["metadata"]["name"]))
        return self._wait(
            f"the Pods of {ns}/{name} to end",
            lambda: not self.kube.list(path, label_selector=selector(name)),
            PODS_GONE_TIMEOUT_S,
        )

    def wipe(self, rm: Mapping[str, Any]) -> list[str]:
        """Remove ``<persistDir>/<uid>`` on every node; returns the nodes where that failed."""
        meta = rm["metadata"]
        persist_dir = (((rm.get("spec") or {}).get("weightSync")) or {}).get("persistDir")
        image = model_image(rm, self.default_image)
        if not persist_dir or not meta.get("uid"):
            return []
        nodes = list(self.nodes())
        if image is None:
            return nodes
        made: dict[str, str] = {}
        failed: list[str] = []
        for node in nodes:
            body = wipe_pod(rm, node, image, persist_dir)
            try:
                self.kube.create(core_path("pods", meta["namespace"]), body)
                made[node] = body["metadata"]["name"]
            except KubeError as exc:  # a namespace being terminated takes no new Pods
                log.warning("cannot wipe %s/%s on node %s: %s", persist_dir, meta["uid"], node, exc)
                failed.append(node)

        def read(pod: str) -> dict[str, Any] | None:
            # a LIST by name: the operator's ClusterRole lists Pods, it does not get them
            found = self.kube.list(
                core_path("pods", meta["namespace"]), field_selector=f"metadata.name={pod}"
            )
            return found[0] if found else None

        self._wait(
            f"the weights of {meta['namespace']}/{meta['name']} to be wiped",
            lambda: all(wipe_finished(read(p)) for p in made.values()),
            WIPE_TIMEOUT_S,
        )
        for node, pod in made.items():
            if ((read(pod) or {}).get("status") or {}).get("phase") != "Succeeded":
                failed.append(node)
            self.kube.delete(core_path("pods", meta["namespace"], pod))
        for node in failed:
            log.warning(
                "the persisted weights of %s/%s (%s/%s) could not be removed on node %s: remove them by hand",
                meta["namespace"],
                meta["name"],
                persist_dir,
                meta["uid"],
                node,
            )
        return failed
