"""Drives WeightSync pushes: reads the cluster, asks the pure ``weightsync`` module what to do, calls
each replica's control plane (through its ``PushReplicas``, ``weightsync_replicas``) and writes the
WeightSync's status.

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
from rewardplane.protocol import STALE_BASE, TRAINER_ABSENT, ParamMeta

from . import weightsync as wsm
from .cluster import Key
from .ownership import of_model
from .replicas import HttpReplicas, ReplicaError, Replicas
from .reporting import now_rfc3339, post_event
from .status import Event
from .weightsync_replicas import PushReplicas

log = logging.getLogger("rewardplane.operator.weightsync")

POLL_S = 0.02  # the replicas' versions during a transfer: how often they are asked


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
    """Runs each WeightSync's push, one per model at a time, and writes how it went."""

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
        self._clock = clock
        self._sleep = sleep
        # (namespace, model) → the WeightSync pushing to it: one push per model at a time (a second
        # one would hold the replicas' joins for its whole timeout, blocking the real push)
        self._pushing: dict[Key, str] = {}
        self._guard = threading.Lock()
        # the replicas' side: candidates, joins, leaving the group, polls during the transfer
        self.members = PushReplicas(
            kube, replicas or HttpReplicas(), stale_pods or (lambda _key: set()), clock, sleep
        )

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
        self.members.leave_group(str(group), urls, token)

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
            plan = wsm.plan_group(self.members.candidates(rm), current, req.training_mode, req.senders)
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

        def waiting(why: str | None) -> None:
            """A replica ending an earlier update is waited for (``why``), or joined after it (None:
            the status's message as it was before the wait)."""
            if why is not None:
                log.info("WeightSync %s/%s: %s", ws["metadata"]["namespace"], ws["metadata"]["name"], why)
            self._patch_status(ws, {"message": why if why is not None else note})

        asked: dict[str, str] = {}
        try:
            for t in plan.targets:
                asked[t.pod] = t.url
                self.members.join(t, token, req, plan.world_size, deadline, waiting)
            # The first announce waits (server side) until the trainer has joined the group.
            for t in plan.targets:
                self.members.announce(t, token, req, metadata, agree, deadline)
                entries[t.pod] = wsm.replica_entry(t, wsapi.TRANSFERRING)
        except BaseException as exc:
            # Before the push is failed: a replica whose join is still pending (the trainer has not
            # joined yet) would refuse the trainer's next push until this push's deadline.
            self.members.leave_group(req.group_id, asked, token)
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

    def _follow(self, ws: Mapping[str, Any], transfer: wsm.Transfer, token: str, started: float) -> None:
        """Poll the replicas until ``step`` says how the transfer ended, then close the push."""
        observations: dict[str, wsm.Observation] = {}
        while True:
            transfer, polls, outcome = wsm.step(transfer, observations, self._clock())
            if outcome is not None:
                break
            if observations:
                self._sleep(POLL_S)
            observations = {t.pod: self.members.observe(t.url, token, transfer.version) for t in polls}
        self._finish(
            ws,
            outcome.phase,
            started,
            reason=outcome.reason,
            message=outcome.message,
            replicas=outcome.replicas,
            bytes_=outcome.bytes,
        )
