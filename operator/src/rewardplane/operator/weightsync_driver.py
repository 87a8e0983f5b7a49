"""Drives WeightSync pushes: reads the cluster, asks the pure ``weightsync`` module what to do, calls
each replica's control plane (through ``Replicas``) and writes the WeightSync's status.

A push runs in the kopf handler of its WeightSync: kopf handles one object at a time, so a new
generation arriving during a push is handled right after it, and no thread of our own is needed.
Following the transfer is the pure ``weightsync.step`` fed with what the replicas answer.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from rewardplane.api import weightsync as wsapi
from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import TOKEN_KEY, token_secret_name
from rewardplane.protocol import (
    STALE_BASE,
    TRAINER_ABSENT,
    UPDATE_IN_PROGRESS,
    InitCommunicatorRequest,
    ParamMeta,
    UpdateParamBatchRequest,
    settings,
)

from . import weightsync as wsm
from .ownership import of_model
from .pods import pod_ready, replica_index
from .render import HTTP_PORT_NAME, selector
from .replicas import HttpReplicas, ReplicaError, Replicas
from .reporting import now_rfc3339, post_event
from .status import Event

log = logging.getLogger("rewardplane.operator.weightsync")

Key = tuple[str, str]
POLL_S = 0.02
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


def model_token(kube: Kube, ns: str, model: str) -> str:
    secret = kube.get(core_path("secrets", ns, token_secret_name(model)))
    raw = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    if not raw:
        raise wsm.WeightSyncRefused(
            wsapi.MODEL_NOT_FOUND,
            f"the control-plane token Secret {token_secret_name(model)} "
            "is missing; the operator creates it when it reconciles the RewardModel",
        )
    return base64.b64decode(raw).decode()


class WeightSyncDriver:
    def __init__(
        self,
        kube: Kube,
        on_done: Callable[[Key], None] | None = None,
        stale_pods: Callable[[Key], set[str]] | None = None,
        replicas: Replicas | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kube = kube
        self.on_done = on_done  # (namespace, model): reconcile the RewardModel after a push
        self.stale_pods = stale_pods or (lambda _key: set())
        self.replicas: Replicas = replicas or HttpReplicas()
        self._clock = clock
        self._sleep = sleep
        # (namespace, model) → the WeightSync pushing to it: one push per model at a time (a second
        # one would hold the replicas' joins for its whole timeout, blocking the real push)
        self._pushing: dict[Key, str] = {}
        self._guard = threading.Lock()

    # ---------------------------------------------------------------- entry point

    def handle(self, key: Key) -> None:
        """Start the push the WeightSync asks for, or finish one an earlier operator left open.

        kopf runs this for one object at a time and a push runs inside it, so a WeightSync found
        started but unfinished here was left by an operator that died (whichever kopf handler
        brings it: a resumed create, or the resume handler)."""
        ns, name = key
        ws = self.kube.get(custom_path(ns, name, wsapi.WS_PLURAL))
        if ws is None:
            return
        if wsm.interrupted(ws):
            started = self._started(ws)
            transfer = wsm.resumable_transfer(ws, self._clock(), self._clock() - started)
            if transfer is not None:
                log.info("WeightSync %s/%s: resuming the transfer the operator was following", ns, name)
                model = str((ws.get("spec") or {}).get("rewardModelRef") or "")
                self._follow(ws, transfer, model_token(self.kube, ns, model), started)
                return
            self._cancel_joins(ws)
            self._finish(
                ws,
                wsm.FAILED,
                started,
                reason=wsapi.OPERATOR_RESTARTED,
                message="the operator restarted before every replica accepted this push; the trainer must push again",
            )
            return
        if not wsm.needs_push(ws):
            return
        self.push(ws)

    def _cancel_joins(self, ws: Mapping[str, Any]) -> None:
        """Replicas the dead operator asked to join the push's group wait for it until that push's
        deadline, and refuse the trainer's next push meanwhile: cancel those joins (and leave the
        group, if it formed). Best effort, as a replica that does not answer ends the join by
        itself at the deadline."""
        status = ws.get("status") or {}
        group = status.get("groupId")
        urls = {
            str(r["pod"]): str(r["url"])
            for r in status.get("replicas") or []
            if r.get("url") and r.get("pod")
        }
        if not group or not urls:
            return
        model = str((ws.get("spec") or {}).get("rewardModelRef") or "")
        try:
            token = model_token(self.kube, ws["metadata"]["namespace"], model)
        except (wsm.WeightSyncRefused, KubeError) as exc:
            log.warning("could not cancel the joins of group %s: %s", group, exc)
            return
        self._leave_group(str(group), urls, token)

    def _leave_group(self, group: str, urls: Mapping[str, str], token: str) -> None:
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

    def _started(self, ws: Mapping[str, Any]) -> float:
        """When the push started, on this driver's clock (from ``status.startedAt``, which survives
        an operator restart)."""
        started_at = (ws.get("status") or {}).get("startedAt")
        return self._clock() - wsm.seconds_since(started_at, datetime.now(timezone.utc))

    # ---------------------------------------------------------------- status

    def _patch_status(self, ws: Mapping[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        meta = ws["metadata"]
        try:
            return self.kube.merge_patch(
                custom_path(meta["namespace"], meta["name"], wsapi.WS_PLURAL) + "/status", {"status": patch}
            )
        except KubeError as exc:
            if exc.status != 404:
                raise
            # deleted mid-push: the push goes on to its end (the trainer may be sending), unrecorded
            log.info("WeightSync %s/%s is gone; its status is not written", meta["namespace"], meta["name"])
            return {}

    def deleted(self, ws: Mapping[str, Any]) -> None:
        """A WeightSync deleted while its push waits for the trainer (Pending, Rendezvous): the
        replicas' joins of its group are cancelled at once, so the push ends now and the model takes
        the next push, instead of both waiting for a trainer that was told to give up. A push
        already Transferring is left to end: the trainer sends to the replicas directly."""
        if ((ws.get("status") or {}).get("phase")) in (wsm.PENDING, wsapi.RENDEZVOUS):
            self._cancel_joins(ws)

    def _finish(
        self,
        ws: Mapping[str, Any],
        phase: str,
        started: float,
        *,
        reason: str | None = None,
        message: str | None = None,
        replicas: list[dict[str, Any]] | None = None,
        bytes_: int | None = None,
    ) -> None:
        current = (
            self.kube.get(custom_path(ws["metadata"]["namespace"], ws["metadata"]["name"], wsapi.WS_PLURAL))
            or ws
        )
        patch = wsm.finish_status(
            current.get("status") or {},
            phase,
            now_rfc3339(),
            self._clock() - started,
            reason=reason,
            message=message,
            replicas=replicas,
            bytes_=bytes_,
        )
        self._patch_status(ws, patch)
        (log.info if phase == wsm.COMPLETED else log.warning)(
            "WeightSync %s/%s version %s %s%s",
            ws["metadata"]["namespace"],
            ws["metadata"]["name"],
            (ws.get("spec") or {}).get("version"),
            phase,
            f" ({reason}: {message})" if reason else "",
        )
        model = (ws.get("spec") or {}).get("rewardModelRef")
        if self.on_done is not None and model:
            try:
                self.on_done((ws["metadata"]["namespace"], model))
            except Exception:
                log.exception("reconciling %s after the push failed", model)

    # ---------------------------------------------------------------- the push

    def _candidates(self, rm: Mapping[str, Any]) -> list[wsm.Candidate]:
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

    def push(self, ws: Mapping[str, Any]) -> None:
        ns, name = ws["metadata"]["namespace"], ws["metadata"]["name"]
        model = str((ws.get("spec") or {}).get("rewardModelRef", ""))
        with self._guard:
            busy = self._pushing.get((ns, model))
            if busy is None:
                self._pushing[(ns, model)] = name
        if busy is not None:
            self._refuse_concurrent(ws, busy)
            return
        try:
            self._push(ws)
        finally:
            with self._guard:
                self._pushing.pop((ns, model), None)

    def _refuse_concurrent(self, ws: Mapping[str, Any], busy: str) -> None:
        """Fail ``ws`` at once: WeightSync ``busy`` pushes to the same model now."""
        ns = ws["metadata"]["namespace"]
        other = self.kube.get(custom_path(ns, busy, wsapi.WS_PLURAL)) or {}
        message = wsm.push_in_progress(ws, other)
        self._patch_status(ws, {"phase": wsm.PENDING, "observedGeneration": ws["metadata"].get("generation")})
        self._finish(ws, wsm.FAILED, self._clock(), reason=wsapi.PUSH_IN_PROGRESS, message=message)
        post_event(self.kube, ws, Event("Warning", wsapi.PUSH_IN_PROGRESS, message))

    def _push(self, ws: Mapping[str, Any]) -> None:
        started = self._clock()
        ns = ws["metadata"]["namespace"]
        model = (ws.get("spec") or {}).get("rewardModelRef", "")
        rm = self.kube.get(custom_path(ns, model)) if model else None
        try:
            req = wsm.parse_push(ws, (rm or {}).get("spec"))
        except wsm.WeightSyncRefused as exc:
            self._patch_status(
                ws, {"phase": wsm.PENDING, "observedGeneration": ws["metadata"].get("generation")}
            )
            self._finish(ws, wsm.FAILED, started, reason=exc.reason, message=str(exc))
            return
        deadline = started + req.timeout_s
        self._patch_status(ws, wsm.start_status(req, now_rfc3339()))
        try:
            if rm is None:
                raise wsm.WeightSyncRefused(
                    wsapi.MODEL_NOT_FOUND,
                    f"RewardModel {ns}/{model} does not exist; create it first or fix spec.rewardModelRef",
                )
            if not ((rm.get("spec") or {}).get("weightSync") or {}).get("enabled", True):
                raise wsm.WeightSyncRefused(
                    wsapi.SYNC_DISABLED,
                    f"RewardModel {model} has spec.weightSync.enabled false; enable it to accept pushes",
                )
            # only this object's pushes: a model created again under the same name starts at 0
            others = [
                w
                for w in of_model(self.kube.list(custom_path(ns, plural=wsapi.WS_PLURAL)), rm)
                if w["metadata"]["name"] != req.name
            ]
            current = wsm.current_version(rm, [*others, *of_model([ws], rm)])
            wsm.check_version(req.version, current)
            cm = self.kube.get(core_path("configmaps", ns, req.config_map)) if req.config_map else None
            if cm is None:
                raise wsm.WeightSyncRefused(
                    wsapi.MANIFEST_INVALID,
                    f"ConfigMap {req.config_map} (spec.manifestRef) "
                    "does not exist; the trainer writes it before the WeightSync",
                )
            metadata = wsapi.decode_manifest(cm, req.manifest_key, req.manifest_sha256)
            token = model_token(self.kube, ns, model)
            plan = wsm.plan_group(self._candidates(rm), current, req.training_mode, req.senders)
            self._run(ws, req, plan, metadata, token, started, deadline)
        except wsm.WeightSyncRefused as exc:
            self._finish(ws, wsm.FAILED, started, reason=exc.reason, message=str(exc))
        except KubeError as exc:
            self._finish(ws, wsm.FAILED, started, reason="ApiError", message=str(exc))
        except Exception as exc:
            # Never leave a started push in a running phase: the trainer would wait for nothing.
            log.exception("push %s/%s failed in the operator", ns, req.name)
            self._finish(
                ws,
                wsm.FAILED,
                started,
                reason=wsapi.OPERATOR_ERROR,
                message=f"the operator failed during this push ({type(exc).__name__}: {exc}); push again",
            )

    def _observe(self, url: str, token: str, version: int) -> wsm.Observation:
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

    def _run(
        self,
        ws: Mapping[str, Any],
        req: wsm.PushRequest,
        plan: wsm.GroupPlan,
        metadata: list[ParamMeta],
        token: str,
        started: float,
        deadline: float,
    ) -> None:
        entries = {t.pod: wsm.replica_entry(t, wsapi.RENDEZVOUS) for t in plan.targets}
        note = f"left out: {'; '.join(plan.skipped)}" if plan.skipped else None
        # the trainer reads it before it joins: it takes part in the agreement only when asked
        agree = req.agree_slicing and plan.agrees_slicing
        self._patch_status(
            ws,
            {
                "phase": wsapi.RENDEZVOUS,
                "worldSize": plan.world_size,
                "senders": req.senders,
                "agreeSlicing": agree,
                "replicas": list(entries.values()),
                "message": note,
            },
        )
        asked: dict[str, str] = {}
        try:
            for t in plan.targets:
                asked[t.pod] = t.url
                self._join(ws, t, token, req, plan.world_size, deadline, note)
            # The first announce waits (server side) until the trainer has joined the group.
            for t in plan.targets:
                left = max(1.0, deadline - self._clock())
                announce = UpdateParamBatchRequest(
                    metadata=metadata,
                    training_mode=req.training_mode,
                    version=req.version,
                    bucket_bytes=req.bucket_bytes,
                    timeout_s=left,
                    adapter=req.adapter,
                    base_version=req.base_version,
                    agree_slicing=agree,
                )
                self.replicas.update_param_batch(t.url, token, announce, left + 5.0)
                entries[t.pod] = wsm.replica_entry(t, wsapi.TRANSFERRING)
        except BaseException as exc:
            # Before the push is failed: a replica whose join is still pending (the trainer has not
            # joined yet) would refuse the trainer's next push until this push's deadline.
            self._leave_group(req.group_id, asked, token)
            if isinstance(exc, ReplicaError) and exc.code == TRAINER_ABSENT:
                raise wsm.WeightSyncRefused(wsapi.TRAINER_NOT_JOINED, wsm.trainer_absent(req)) from exc
            if isinstance(exc, ReplicaError):
                reason = wsapi.DELTA_REFUSED if exc.code == STALE_BASE else wsapi.REPLICA_REFUSED
                raise wsm.WeightSyncRefused(reason, str(exc)) from exc
            raise
        self._patch_status(ws, {"phase": wsapi.TRANSFERRING, "replicas": list(entries.values())})

        transfer = wsm.Transfer(
            version=req.version,
            timeout_s=req.timeout_s,
            nbytes=wsm.push_bytes(metadata, req.bucket_bytes),
            targets=plan.targets,
            announced=self._clock(),
            deadline=deadline,
        )
        # Recorded before the transfer, so an operator that restarts meanwhile can follow it.
        self._patch_status(ws, {"bytes": transfer.nbytes})
        self._follow(ws, transfer, token, started)

    def _join(
        self,
        ws: Mapping[str, Any],
        t: wsm.Target,
        token: str,
        req: wsm.PushRequest,
        world_size: int,
        deadline: float,
        message: str | None,
    ) -> None:
        """Ask replica ``t`` to join the trainer's group. A replica still ending an earlier update
        (it refuses, and reports a background task: the transfer of a push whose operator died,
        which fails by itself once that trainer's group is gone) is waited for, as its answer
        asks, until the push's deadline; one whose update ended between its refusal and the
        question whether one runs is asked again at once; any other refusal fails the push at once."""
        waiting = asked_again = False
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
                        timeout_s=min(MAX_JOIN_S, max(1.0, deadline - self._clock())),
                        group_id=req.group_id,
                        senders=req.senders,
                    ),
                )
                if waiting:  # the status's message as it was before the wait
                    self._patch_status(ws, {"message": message})
                return
            except ReplicaError as exc:
                if self._clock() + BUSY_POLL_S > deadline:
                    raise
                if not self._busy(t.url, token):
                    # refused for an update that ended before the question whether one runs: ask again
                    if exc.code != UPDATE_IN_PROGRESS or asked_again:
                        raise
                    asked_again = True
                    continue
                asked_again = False
                if not waiting:
                    waiting = True
                    note = f"waiting for {t.pod} to end an earlier update before it joins ({exc})"
                    log.info(
                        "WeightSync %s/%s: %s", ws["metadata"]["namespace"], ws["metadata"]["name"], note
                    )
                    self._patch_status(ws, {"message": note})
            self._sleep(BUSY_POLL_S)

    def _busy(self, url: str, token: str) -> bool:
        """Whether the replica reports a weight update still running (its background task)."""
        try:
            tasks = self.replicas.background_tasks(url, token)
            return int(tasks.get("num_background_tasks") or 0) > 0
        except (ReplicaError, TypeError, ValueError):
            return False

    def _follow(self, ws: Mapping[str, Any], transfer: wsm.Transfer, token: str, started: float) -> None:
        """Poll the replicas until ``step`` says how the transfer ended, then close the push."""
        observations: dict[str, wsm.Observation] = {}
        while True:
            transfer, polls, outcome = wsm.step(transfer, observations, self._clock())
            if outcome is not None:
                break
            if observations:
                self._sleep(POLL_S)
            observations = {t.pod: self._observe(t.url, token, transfer.version) for t in polls}
        self._finish(
            ws,
            outcome.phase,
            started,
            reason=outcome.reason,
            message=outcome.message,
            replicas=outcome.replicas,
            bytes_=outcome.bytes,
        )
