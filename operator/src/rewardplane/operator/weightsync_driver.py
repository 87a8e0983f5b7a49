"""Drives WeightSync pushes: reads the cluster, asks the pure ``weightsync`` module what to do, calls
each replica's control plane and writes the WeightSync's status.

Each push runs on a thread of its own (a push lasts as long as the transfer; the kopf handler only
starts it). One push per WeightSync at a time: a new generation arriving meanwhile runs right after.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import httpx

from rewardplane.api import weightsync as wsapi
from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import TOKEN_KEY, token_secret_name
from rewardplane.protocol import (
    Endpoints,
    InitCommunicatorRequest,
    ParamMeta,
    UpdateParamBatchRequest,
)

from . import weightsync as wsm
from .coalesce import Coalescer
from .render import HTTP_PORT_NAME, selector
from .status import pod_ready, replica_index

log = logging.getLogger("rewardplane.operator.weightsync")

Key = tuple[str, str]
POLL_S = 0.02
HTTP_TIMEOUT = httpx.Timeout(10.0, connect=3.0)


def now_rfc3339() -> str:
    from .reconcile import now_rfc3339 as now

    return now()


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
    ) -> None:
        self.kube = kube
        self.on_done = on_done  # (namespace, model): reconcile the RewardModel after a push
        self.stale_pods = stale_pods or (lambda _key: set())
        self._coalesce: Coalescer[Key] = Coalescer()

    # ---------------------------------------------------------------- entry points

    def request(self, key: Key, *, resumed: bool = False) -> None:
        """Handle the WeightSync ``key`` on a thread of its own (coalesced per object)."""
        if not self._coalesce.begin(key):
            return
        threading.Thread(
            target=self._loop, args=(key, resumed), name=f"weightsync-{key[1]}", daemon=True
        ).start()

    def _loop(self, key: Key, resumed: bool) -> None:
        first = [resumed]

        def once() -> None:
            try:
                self.handle(key, resumed=first[0])
            except Exception:  # never lose the thread silently; the next event retries
                log.exception("handling WeightSync %s/%s failed", *key)
            first[0] = False

        self._coalesce.loop(key, once)

    def handle(self, key: Key, *, resumed: bool = False) -> None:
        ns, name = key
        ws = self.kube.get(custom_path(ns, name, wsapi.WS_PLURAL))
        if ws is None:
            return
        if resumed and wsm.interrupted(ws):
            started = self._started_monotonic(ws)
            self._finish(
                ws,
                wsm.FAILED,
                started,
                reason=wsapi.OPERATOR_RESTARTED,
                message="the operator restarted during this push; the trainer must push again",
            )
            return
        if not wsm.needs_push(ws):
            return
        self.push(ws)

    @staticmethod
    def _started_monotonic(ws: Mapping[str, Any]) -> float:
        """When the push started, on this process's monotonic clock (from ``status.startedAt``)."""
        started_at = (ws.get("status") or {}).get("startedAt")
        return time.monotonic() - wsm.seconds_since(started_at, datetime.now(timezone.utc))

    # ---------------------------------------------------------------- status

    def _patch_status(self, ws: Mapping[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
        meta = ws["metadata"]
        body = self.kube.merge_patch(
            custom_path(meta["namespace"], meta["name"], wsapi.WS_PLURAL) + "/status", {"status": patch}
        )
        return body

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
            time.monotonic() - started,
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

    def _candidates(self, ns: str, model: str, http: httpx.Client) -> list[wsm.Candidate]:
        stale = self.stale_pods((ns, model))
        out: list[wsm.Candidate] = []
        for pod in self.kube.list(core_path("pods", ns), label_selector=selector(model)):
            port, index = http_port(pod), replica_index(pod)
            if not running(pod) or port is None or index is None:
                continue
            url = f"http://{pod['status']['podIP']}:{port}"
            try:
                runtime = http.get(url + Endpoints.RUNTIME_VERSION, timeout=HTTP_TIMEOUT).json()
                world = http.get(url + Endpoints.WORLD_SIZE, timeout=HTTP_TIMEOUT).json()["world_size"]
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.info("replica %s left out of the push: %s", pod["metadata"]["name"], exc)
                continue
            out.append(
                wsm.Candidate(
                    index,
                    pod["metadata"]["name"],
                    url,
                    int(world),
                    int(runtime["version"]),
                    str(runtime.get("state") or ""),
                    pod["metadata"]["name"] in stale,
                )
            )
        return out

    def push(self, ws: Mapping[str, Any]) -> None:
        started = time.monotonic()
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
        http = httpx.Client()
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
            others = [
                w
                for w in self.kube.list(custom_path(ns, plural=wsapi.WS_PLURAL))
                if w["metadata"]["name"] != req.name
            ]
            wsm.check_version(req.version, wsm.current_version(rm, [*others, ws]))
            cm = self.kube.get(core_path("configmaps", ns, req.config_map)) if req.config_map else None
            if cm is None:
                raise wsm.WeightSyncRefused(
                    wsapi.MANIFEST_INVALID,
                    f"ConfigMap {req.config_map} (spec.manifestRef) "
                    "does not exist; the trainer writes it before the WeightSync",
                )
            metadata = wsapi.decode_manifest(cm, req.manifest_key, req.manifest_sha256)
            token = model_token(self.kube, ns, model)
            http.headers["Authorization"] = f"Bearer {token}"
            current = wsm.current_version(rm, [*others, ws])
            plan = wsm.plan_group(self._candidates(ns, model, http), current, req.training_mode)
            self._run(ws, req, plan, metadata, http, started, deadline)
        except wsm.WeightSyncRefused as exc:
            self._finish(ws, wsm.FAILED, started, reason=exc.reason, message=str(exc))
        except KubeError as exc:
            self._finish(ws, wsm.FAILED, started, reason="ApiError", message=str(exc))
        finally:
            http.close()

    def _post(self, http: httpx.Client, url: str, path: str, body: dict[str, Any], timeout_s: float) -> None:
        try:
            resp = http.post(url + path, json=body, timeout=httpx.Timeout(timeout_s, connect=3.0))
        except httpx.HTTPError as exc:
            raise wsm.WeightSyncRefused(wsapi.REPLICA_REFUSED, f"{url}{path} did not answer: {exc}") from exc
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("error") or resp.text
            except ValueError:
                detail = resp.text
            raise wsm.WeightSyncRefused(
                wsapi.REPLICA_REFUSED, f"{url}{path} answered {resp.status_code}: {detail}"
            )

    def _run(
        self,
        ws: Mapping[str, Any],
        req: wsm.PushRequest,
        plan: wsm.GroupPlan,
        metadata: list[ParamMeta],
        http: httpx.Client,
        started: float,
        deadline: float,
    ) -> None:
        entries = {t.pod: wsm.replica_entry(t, wsapi.RENDEZVOUS) for t in plan.targets}
        note = f"left out: {'; '.join(plan.skipped)}" if plan.skipped else None
        self._patch_status(
            ws,
            {
                "phase": wsapi.RENDEZVOUS,
                "worldSize": plan.world_size,
                "replicas": list(entries.values()),
                "message": note,
            },
        )
        remaining = max(1.0, deadline - time.monotonic())
        for t in plan.targets:
            body = InitCommunicatorRequest(
                host=req.address,
                port=req.port,
                world_size=plan.world_size,
                rank_offset=t.rank_offset,
                timeout_s=remaining,
                group_id=req.group_id,
            )
            self._post(http, t.url, Endpoints.INIT_COMMUNICATOR, body.model_dump(mode="json"), 10.0)
        announce = UpdateParamBatchRequest(
            metadata=metadata,
            training_mode=req.training_mode,
            version=req.version,
            bucket_bytes=req.bucket_bytes,
            timeout_s=remaining,
        )
        payload = announce.model_dump(mode="json")
        # The first announce waits (server side) until the trainer has joined the group.
        for t in plan.targets:
            left = max(1.0, deadline - time.monotonic())
            payload["timeout_s"] = left
            self._post(http, t.url, Endpoints.UPDATE_PARAM_BATCH, payload, left + 5.0)
            entries[t.pod] = wsm.replica_entry(t, wsapi.TRANSFERRING)
        announced = time.monotonic()
        self._patch_status(ws, {"phase": wsapi.TRANSFERRING, "replicas": list(entries.values())})
        nbytes = wsm.push_bytes(metadata, req.bucket_bytes)

        pending = {t.pod: t for t in plan.targets}
        failures: list[str] = []
        while pending and time.monotonic() < deadline:
            for pod, t in list(pending.items()):
                runtime = tasks = None
                try:
                    runtime = http.get(t.url + Endpoints.RUNTIME_VERSION, timeout=HTTP_TIMEOUT).json()
                    if int(runtime.get("version", -1)) < req.version:
                        tasks = http.get(t.url + Endpoints.NUM_BACKGROUND_TASKS, timeout=HTTP_TIMEOUT).json()
                except (httpx.HTTPError, ValueError) as exc:
                    log.debug("polling %s: %s", t.url, exc)
                outcome, message = wsm.replica_outcome(req.version, runtime, tasks)
                if outcome is None:
                    continue
                del pending[pod]
                took = round(time.monotonic() - announced, 4)
                if outcome == wsm.COMPLETED:
                    entries[pod] = wsm.replica_entry(
                        t, wsm.COMPLETED, version=req.version, bytes=nbytes, durationSeconds=took
                    )
                else:
                    failures.append(f"{pod}: {message}")
                    entries[pod] = wsm.replica_entry(
                        t,
                        wsm.FAILED,
                        durationSeconds=took,
                        message=(message or "")[:1000],
                        version=int(runtime["version"]) if runtime else None,
                    )
            if pending:
                time.sleep(POLL_S)
        for pod, t in pending.items():
            failures.append(f"{pod}: did not serve version {req.version} within {req.timeout_s:.0f}s")
            entries[pod] = wsm.replica_entry(t, wsm.FAILED, message="timed out")
        replicas = [entries[t.pod] for t in plan.targets]
        if failures:
            reason = wsapi.TIMEOUT if pending and len(pending) == len(failures) else wsapi.REPLICA_FAILED
            self._finish(
                ws,
                wsm.FAILED,
                started,
                reason=reason,
                replicas=replicas,
                bytes_=0,
                message=f"version {req.version} failed on {len(failures)} replica(s): "
                + "; ".join(failures)
                + " (the trainer may have died or timed out; push again)",
            )
            return
        self._finish(
            ws,
            wsm.COMPLETED,
            started,
            replicas=replicas,
            bytes_=nbytes,
            message=f"{len(replicas)} replica(s) serve version {req.version}",
        )
