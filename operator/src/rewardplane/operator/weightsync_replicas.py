"""The replicas' side of a WeightSync push: which replicas can take it, asking each to join the
push's group (waiting for one still ending an earlier update) or to leave it, and what each
answers while the transfer runs. ``weightsync_driver`` owns one and writes the status."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rewardplane.api.kube import Kube, core_path
from rewardplane.protocol import (
    UPDATE_IN_PROGRESS,
    InitCommunicatorRequest,
    ParamMeta,
    UpdateParamBatchRequest,
    settings,
)

from . import weightsync as wsm
from .cluster import Key
from .ownership import of_model
from .pods import pod_ready, replica_index
from .render import HTTP_PORT_NAME, selector
from .replicas import ReplicaError, Replicas

log = logging.getLogger("rewardplane.operator.weightsync")

BUSY_POLL_S = 0.2  # a replica still ending an earlier update: how often to ask again
MAX_JOIN_S = settings.MAX_JOIN_TIMEOUT_S.default


def http_port(pod: Mapping[str, Any]) -> int | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == HTTP_PORT_NAME:
                return int(port["containerPort"])
    return None


def running(pod: Mapping[str, Any]) -> bool:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    states = [c.get("state") or {} for c in status.get("containerStatuses") or []]
    return pod_ready(pod) or any("running" in s for s in states)


@dataclass
class PushReplicas:
    """Calls a model's replicas for its pushes. ``stale_pods(key)``: the replicas the reconciler
    found serving other weights than the model's version (the plan leaves them out)."""

    kube: Kube
    replicas: Replicas
    stale_pods: Callable[[Key], set[str]]
    clock: Callable[[], float]
    sleep: Callable[[float], None]

    def candidates(self, rm: Mapping[str, Any]) -> list[wsm.Candidate]:
        ns, model = rm["metadata"]["namespace"], rm["metadata"]["name"]
        stale = self.stale_pods((ns, model))
        out: list[wsm.Candidate] = []
        pods = self.kube.list(core_path("pods", ns), label_selector=selector(model))
        for pod in of_model(pods, rm):  # not an earlier object's Pods, still terminating
            port, index = http_port(pod), replica_index(pod)
            if not running(pod) or port is None or index is None:
                continue
            url = f"http://{pod['status']['podIP']}:{port}"
            try:
                runtime = self.replicas.runtime(url)
                world = self.replicas.world_size(url)
                version = int(runtime["version"])
            except (ReplicaError, KeyError, TypeError, ValueError) as exc:
                log.info("replica %s left out of the push: %s", pod["metadata"]["name"], exc)
                continue
            name = pod["metadata"]["name"]
            out.append(
                wsm.Candidate(
                    index,
                    name,
                    url,
                    world,
                    version,
                    str(runtime.get("state") or ""),
                    name in stale,
                    runtime.get("agrees_slicing") is True,
                )
            )
        return out

    def join(
        self,
        t: wsm.Target,
        token: str,
        req: wsm.PushRequest,
        world_size: int,
        deadline: float,
        waiting: Callable[[str | None], None],
    ) -> None:
        """Ask replica ``t`` to join the trainer's group. A replica still ending an earlier update
        (it refuses, and reports a background task: the transfer of a push whose operator died,
        which fails by itself once that trainer's group is gone) is waited for, as its answer
        asks, until the push's deadline; one whose update ended between its refusal and the
        question whether one runs is asked again at once; any other refusal fails the push at once.
        ``waiting`` is told why when such a wait starts, and None when the replica joined after it."""
        waited = asked_again = False
        while True:
            try:
                self.replicas.init_communicator(
                    t.url,
                    token,
                    InitCommunicatorRequest(
                        host=req.address,
                        port=req.port,
                        world_size=world_size,
                        rank_offset=t.rank_offset,
                        # a server refuses more than its maximum join (600 s unless set lower)
                        timeout_s=min(MAX_JOIN_S, max(1.0, deadline - self.clock())),
                        group_id=req.group_id,
                        senders=req.senders,
                    ),
                )
                if waited:
                    waiting(None)
                return
            except ReplicaError as exc:
                if self.clock() + BUSY_POLL_S > deadline:
                    raise
                if not self.busy(t.url, token):
                    # refused for an update that ended before the question whether one runs: ask again
                    if exc.code != UPDATE_IN_PROGRESS or asked_again:
                        raise
                    asked_again = True
                    continue
                asked_again = False
                if not waited:
                    waited = True
                    waiting(f"waiting for {t.pod} to end an earlier update before it joins ({exc})")
            self.sleep(BUSY_POLL_S)

    def announce(
        self,
        t: wsm.Target,
        token: str,
        req: wsm.PushRequest,
        metadata: list[ParamMeta],
        agree_slicing: bool,
        deadline: float,
    ) -> None:
        """Announce the push's update to replica ``t``, which has joined the group; the first
        announce waits (server side) until the trainer has joined it too."""
        left = max(1.0, deadline - self.clock())
        announce = UpdateParamBatchRequest(
            metadata=metadata,
            training_mode=req.training_mode,
            version=req.version,
            bucket_bytes=req.bucket_bytes,
            timeout_s=left,
            adapter=req.adapter,
            base_version=req.base_version,
            agree_slicing=agree_slicing,
        )
        self.replicas.update_param_batch(t.url, token, announce, left + 5.0)

    def busy(self, url: str, token: str) -> bool:
        """Whether the replica reports a weight update still running (its background task)."""
        try:
            tasks = self.replicas.background_tasks(url, token)
            return int(tasks.get("num_background_tasks") or 0) > 0
        except (ReplicaError, TypeError, ValueError):
            return False

    def leave_group(self, group: str, urls: Mapping[str, str], token: str) -> None:
        """Ask each replica (pod → URL) to cancel its join of ``group`` or leave it. Scoped to that
        group, so a replica that moved on is left alone; one busy with that group's update, or not
        answering, is skipped: it ends by that push's deadline."""
        for pod, url in urls.items():
            try:
                answer = self.replicas.close_communicator(url, token, group)
            except ReplicaError as exc:
                log.info("%s: could not close group %s (%s)", pod, group, exc)
                continue
            if answer.cancelled_join is not None:
                log.info(
                    "%s: cancelled its join of group %s (pending %.1fs)",
                    pod,
                    group,
                    answer.cancelled_join.pending_s,
                )
            elif answer.closed:
                log.info("%s: left group %s", pod, group)

    def observe(self, url: str, token: str, version: int) -> wsm.Observation:
        """One poll of a replica; what it did not answer stays None (the step waits for it)."""
        try:
            runtime = self.replicas.runtime(url)
        except ReplicaError as exc:
            log.debug("polling %s: %s", url, exc)
            return wsm.Observation()
        if int(runtime.get("version", -1)) >= version:
            return wsm.Observation(runtime)
        try:
            return wsm.Observation(runtime, self.replicas.background_tasks(url, token))
        except ReplicaError as exc:
            log.debug("polling %s: %s", url, exc)
            return wsm.Observation(runtime)
