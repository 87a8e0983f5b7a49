"""Read → plan → apply for one RewardModel, and cleanup on delete.

Everything decided here comes from the pure modules (planning, render, status); this module only
reads the cluster, creates/deletes children and writes status and Events. Reconciles of one model
are coalesced: a request arriving while one runs makes it run once more, never twice at once.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import httpx

from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import ANNOTATION_GROUP_PORT, API_VERSION, WS_PLURAL
from rewardplane.api.names import RM_KIND as KIND
from rewardplane.api.spec import GpuMode, InvalidSpecError
from rewardplane.protocol import AdmissionRequest, RestoreWeightsRequest

from . import metrics
from .cluster import (
    NETWORK_POLICIES,
    SECRETS,
    SERVICES,
    ApiCluster,
    ClusterReader,
    freshest,
    network_policy_path,
    plain,
)
from .coalesce import Coalescer
from .planning import ClusterView, Plan, gpus_in_use, plan_reward_model
from .recovery import Identity, admission_changes, identity, restore_plan, stale_replicas
from .render import (
    ANNOTATION_SPEC_HASH,
    TOKEN_KEY,
    network_policy_name,
    new_token,
    render_children,
    render_network_policy,
    render_token_secret,
    selector,
    token_secret_name,
)
from .replicas import HttpReplicas, Receiver, ReplicaError, Replicas, restore_from_peer
from .rollout import pod_actions
from .status import (
    Event,
    ProbeResult,
    compute_status,
    pod_ready,
    pod_restarts,
    replica_index,
    restore_failed_message,
    server_started,
    transition_events,
    waits_for_mount,
)
from .weightsync import completed_version

log = logging.getLogger("rewardplane.operator")


COMPONENT = "rewardplane-operator"
_EVENT_MESSAGE_LIMIT = 1024  # the API server refuses longer Event messages
RESTORE_TIMEOUT_S = 300.0  # loading saved weights from disk, or receiving them from a peer
PEER_RETRY_S = 5.0  # after a peer restore could not start (the source was busy, a call failed)
# A started replica that could not be probed or admitted yet is looked at again this soon (its Pod
# sends no further event until it is Ready, which needs the admission).
ADMISSION_RETRY_S = 1.0
MOUNT_RECHECK_S = 5.0  # a Pod stuck in ContainerCreating: its FailedMount Events are read again


def _owned_by(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = owner["metadata"].get("uid")
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


Key = tuple[str, str]  # (namespace, name)
Later = Callable[[float, Callable[[], None]], None]


def in_background(delay_s: float, work: Callable[[], None]) -> None:
    """Run ``work`` on a daemon thread of its own after ``delay_s`` seconds."""
    timer = threading.Timer(delay_s, work)
    timer.daemon = True
    timer.start()


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        namespace: str | None = None,
        replicas: Replicas | None = None,
        *,
        delete_children: bool = False,
        later: Later = in_background,
    ) -> None:
        self.kube = kube
        # Where follow-up work runs (an admission retry, following a peer restore); unit tests
        # pass a recorder and run it themselves.
        self.later = later
        self.namespace = namespace  # None: the whole cluster
        # A cluster with a garbage collector (every real one) deletes the owned children itself;
        # only a control plane without a controller-manager (the node-agent dev cluster) needs us to.
        self.delete_children = delete_children
        self.replicas: Replicas = replicas or HttpReplicas()
        # kopf's indexes once the handlers attach them (cost per reconcile independent of the
        # number of models); until then, and in tests without kopf, the API server itself.
        self.cluster: ClusterReader | None = None
        self._guard = threading.Lock()
        self._coalesce: Coalescer[Key] = Coalescer()
        self._phases: dict[Key, str] = {}
        self._pod_states: dict[Key, object] = {}
        self._stale: dict[Key, set[str]] = {}
        self._serving: dict[Key, dict[str, Identity]] = {}  # pod → identity last seen on the model's version
        self._restore_failed: dict[Key, Identity] = {}  # (ns, pod) → identity a disk restore failed for
        # (ns, pod) → (identity, monotonic deadline) of a peer restore in flight (or its retry delay)
        self._restoring: dict[Key, tuple[Identity, float]] = {}
        self._unrecoverable_told: dict[Key, Identity] = {}
        # The model as our last status PATCH answered, until the index has caught up with it.
        self._written: dict[Key, dict[str, Any]] = {}
        self._retry_pending: set[Key] = set()  # models with an admission retry timer running

    # ---------------------------------------------------------------- entry points

    def request(self, key: Key, trigger: str) -> None:
        """Reconcile ``key`` now, or once more right after the reconcile already running for it."""
        self._coalesce.run(key, lambda: self._timed(key, trigger))

    def _timed(self, key: Key, trigger: str) -> None:
        started = time.perf_counter()
        result = "ok"
        try:
            result = self.reconcile(key)
        except (KubeError, httpx.HTTPError) as exc:
            # Transient API trouble: log it; the periodic timer retries, so no retry storm here.
            result = "error"
            metrics.ERRORS.labels(stage="api").inc()
            log.warning("reconcile of %s/%s failed, retrying on the next timer tick: %s", *key, exc)
        finally:
            metrics.DURATION.observe(time.perf_counter() - started)
            metrics.RECONCILES.labels(trigger=trigger, result=result).inc()

    def pod_state_changed(self, pod: Key, state: object | None) -> bool:
        """Remember what matters of a Pod (None: deleted); True when it differs from last time."""
        with self._guard:
            before = self._pod_states.get(pod, ...)
            if state is None:
                self._pod_states.pop(pod, None)
            else:
                self._pod_states[pod] = state
            return before != state

    def stale_pods(self, key: Key) -> set[str]:
        """Pods of the model that restarted onto older weights and wait for (or undergo) a restore."""
        with self._guard:
            return set(self._stale.get(key, ()))

    def forget(self, key: Key) -> None:
        self._phases.pop(key, None)
        self._written.pop(key, None)
        self._stale.pop(key, None)
        self._serving.pop(key, None)
        self._update_phase_gauge()

    # ---------------------------------------------------------------- read

    def _reader(self) -> ClusterReader:
        return self.cluster or ApiCluster(self.kube, self.namespace)

    def _model(self, key: Key) -> dict[str, Any] | None:
        if self.cluster is None:
            return self.kube.get(custom_path(*key))
        indexed = self.cluster.model(*key)
        rm = freshest(indexed, self._written.get(key))
        if rm is indexed:
            self._written.pop(key, None)  # the index has caught up (or the model is gone)
        return rm

    def _cluster_view(self, rm: Mapping[str, Any], own_pods: list[dict[str, Any]]) -> ClusterView:
        meta = rm["metadata"]
        key = (meta["namespace"], meta["name"])
        cluster = self._reader()
        on_cpu = ((rm.get("spec") or {}).get("gpu") or {}).get("mode") == GpuMode.NONE.value
        # Device memory is a cluster-wide resource: every RewardModel and Pod counts, whatever its
        # namespace; a model on CPU holds none, so its plan needs only the nodes.
        peers = (
            []
            if on_cpu
            else [p for p in cluster.models() if (p["metadata"]["namespace"], p["metadata"]["name"]) != key]
        )
        pods = [] if on_cpu else cluster.pods()
        current = {
            i: p["spec"]["nodeName"]
            for p in own_pods
            if (i := replica_index(p)) is not None
            and p["spec"].get("nodeName")
            and not p["metadata"].get("deletionTimestamp")
        }
        return ClusterView(
            nodes=tuple(cluster.nodes()),
            peers=tuple(peers),
            gpus_in_use=gpus_in_use(pods, exclude_model=key),
            current_nodes=current,
        )

    def _probe(self, plan: Plan | None, pods: list[dict[str, Any]]) -> dict[str, ProbeResult]:
        results: dict[str, ProbeResult] = {}
        for pod in pods:
            ip = (pod.get("status") or {}).get("podIP")
            if plan is None or not ip or not server_started(pod):
                continue
            results[pod["metadata"]["name"]] = self.replicas.probe(self._url(pod, plan))
        return results

    # ---------------------------------------------------------------- apply

    # The children are read from the indexes: one the index has not seen yet is created again
    # (answered 409, nothing changes) and one patched moments ago is patched again to the same spec.

    def _ensure_secret(self, rm: Mapping[str, Any]) -> None:
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        # Created once: servers read the token at start, rotating it would lock everyone out.
        if self._reader().child(SECRETS, ns, token_secret_name(name)) is None:
            self.kube.create(core_path("secrets", ns), render_token_secret(rm, new_token()))

    def _ensure_service(self, ns: str, service: dict[str, Any]) -> None:
        path = core_path("services", ns, service["metadata"]["name"])
        existing = self._reader().child(SERVICES, ns, service["metadata"]["name"])
        if existing is None:
            self.kube.create(core_path("services", ns), service)
            return
        # Ports follow the spec; the API server defaults other fields, so compare only what we own.
        wanted = {k: service["spec"][k] for k in ("ports", "selector")}
        if any(existing["spec"].get(k) != v for k, v in wanted.items()):
            self.kube.merge_patch(path, {"spec": wanted})

    def _ensure_network_policy(self, rm: Mapping[str, Any], plan: Plan) -> None:
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        path = network_policy_path(ns, network_policy_name(name))
        existing = self._reader().child(NETWORK_POLICIES, ns, network_policy_name(name))
        if not plan.spec.network_policy.enabled:
            if existing is not None:
                self.kube.delete(path)
            return
        policy = render_network_policy(rm, plan)
        if existing is None:
            self.kube.create(network_policy_path(ns), policy)
        elif existing.get("spec") != policy["spec"]:
            self.kube.merge_patch(path, {"spec": policy["spec"]})

    def _apply_pods(
        self, ns: str, desired: list[dict[str, Any]], pods: list[dict[str, Any]]
    ) -> list[dict[str, Any]] | None:
        """Create and delete Pods one rollout step; the model's Pods afterwards when that follows
        from what the API server answered (nothing deleted, every create accepted), else None."""
        actions = pod_actions(desired, pods)
        for name, why in actions.delete:
            self._delete_pod(ns, name, why)
        after: list[dict[str, Any]] | None = None if actions.delete else list(pods)
        for pod in actions.create:
            created = self.kube.create(core_path("pods", ns), pod)
            if created is None:
                after = None  # it existed already: what it is, only a read can say
                continue
            metrics.POD_ACTIONS.labels(action="create").inc()
            log.info("created pod %s/%s on node %s", ns, pod["metadata"]["name"], pod["spec"]["nodeName"])
            if after is not None:
                after.append(plain(created))
        return after

    def _delete_pod(self, ns: str, name: str, why: str) -> None:
        if self.kube.delete(core_path("pods", ns, name)):
            metrics.POD_ACTIONS.labels(action="delete").inc()
            log.info("deleted pod %s/%s (%s)", ns, name, why)

    # ---------------------------------------------------------------- status and events

    def _write_status(self, rm: Mapping[str, Any], status: dict[str, Any]) -> None:
        previous = rm.get("status") or {}
        key = (rm["metadata"]["namespace"], rm["metadata"]["name"])
        self._phases[key] = status["phase"]
        self._update_phase_gauge()
        # A field the status no longer has (status.reason once Ready) is removed: a merge patch
        # keeps whatever it does not name, so it names them with null.
        gone = {k: None for k in previous if k not in status}
        if not gone and all(previous.get(k) == v for k, v in status.items()):
            return  # unchanged: no write, no watch event, no churn
        written = self.kube.merge_patch(
            custom_path(key[0], key[1]) + "/status", {"status": {**status, **gone}}
        )
        if self.cluster is not None and written:
            self._written[key] = plain(written)
        for event in transition_events(previous, status):
            self._post_event(rm, event)

    def _post_event(self, rm: Mapping[str, Any], event: Event) -> None:
        meta = rm["metadata"]
        stamp = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid", ""),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:_EVENT_MESSAGE_LIMIT],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            self.kube.create(core_path("events", meta["namespace"]), body)
        except KubeError as exc:  # an Event is best effort; the status already says it all
            log.warning(
                "could not post event %s for %s/%s: %s", event.reason, meta["namespace"], meta["name"], exc
            )
        (log.warning if event.type == "Warning" else log.info)(
            "%s/%s %s: %s", meta["namespace"], meta["name"], event.reason, event.message
        )

    def _update_phase_gauge(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase in ("Pending", "Progressing", "Ready", "Degraded", "Failed"):
            metrics.MODELS.labels(phase=phase).set(counts.get(phase, 0))

    # ---------------------------------------------------------------- the loop body

    def reconcile(self, key: Key) -> str:
        """One pass for one RewardModel; returns the metrics result label."""
        ns, name = key
        rm = self._model(key)
        if rm is None or rm["metadata"].get("deletionTimestamp"):
            return "gone"  # the delete handler cleans up
        cluster = self._reader()
        # The model's Pods as kopf's watch last saw them: a LIST per reconcile made the API server
        # decode every Pod of the namespace, seconds per call at 1000 models (benchmarks/README.md).
        # Deletions are decided again on a fresh LIST below (a Pod the index shows may have been
        # replaced under the same name since); a create needs none: a Pod that exists is a 409.
        pods = cluster.pods_of(ns, name)
        try:
            plan = plan_reward_model(rm, self._cluster_view(rm, pods))
            desired, service = render_children(rm, plan)
            if self.cluster is not None and pod_actions(desired, pods).delete:
                pods = self.kube.list(core_path("pods", ns), label_selector=selector(name))
                plan = plan_reward_model(rm, self._cluster_view(rm, pods))
                desired, service = render_children(rm, plan)
        except InvalidSpecError as exc:
            # Leave running children alone (a typo must not take a model down) and say what to fix.
            status = compute_status(
                rm, None, pods, {}, now_rfc3339(), errors=exc.errors, error_reason=exc.reason
            )
            self._write_status(rm, status)
            return "invalid"
        self._ensure_secret(rm)
        self._ensure_service(ns, service)
        self._ensure_network_policy(rm, plan)
        after = self._apply_pods(ns, desired, pods)
        if after is None:
            pods = self.kube.list(core_path("pods", ns), label_selector=selector(name))
        else:
            pods = after
        hashes = {p["metadata"]["name"]: p["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for p in desired}
        known = completed_version(cluster.weightsyncs(ns, name), name)
        probes = self._probe(plan, pods)
        target = max(
            [
                known or 0,
                int((rm.get("status") or {}).get("weightsVersion") or 0),
                *(p.version for p in probes.values() if p.version is not None and p.error is None),
            ]
        )
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        with self._guard:
            stale, self._serving[key] = stale_replicas(
                live, probes, target, self._serving.get(key, {}), completed=known or 0
            )
            newly = stale - self._stale.get(key, set())
            self._stale[key] = stale
        self._admit(rm, plan, live, probes, stale, target)
        for pod in sorted(newly):
            self._post_event(
                rm,
                Event(
                    "Warning",
                    "ReplicaStale",
                    f"{pod} restarted and serves weights version "
                    f"{probes[pod].version} < {target}; left out of the endpoints until restored",
                ),
            )
        restored, lost = self._restore(rm, plan, live, probes, stale, target) if stale else (False, ())
        status = compute_status(
            rm,
            plan,
            pods,
            probes,
            now_rfc3339(),
            desired_hashes=hashes,
            target_version=target,
            stale_pods=stale,
            mount_problems=self._mount_problems(key, live),
            lost_pods=lost,
        )
        self._write_status(rm, status)
        if restored:
            self._coalesce.mark_dirty(key)  # re-read the restored replicas (or try a peer) right away
        return "ok"

    def _admit(
        self,
        rm: Mapping[str, Any],
        plan: Plan,
        pods: list[dict[str, Any]],
        probes: Mapping[str, ProbeResult],
        stale: set[str],
        target: int,
    ) -> None:
        """Admit the replicas that serve ``target`` and take the admission back from stale ones;
        the kubelet's next readiness probe moves them in or out of the Service's endpoints. A started
        replica not admitted yet (no answer, or a refused admission) is looked at again shortly."""
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        by_name = {p["metadata"]["name"]: p for p in pods}
        changes = admission_changes({n: p for n, p in probes.items() if n in by_name}, target, stale)
        retry = any(
            server_started(p) and not pod_ready(p) and (probes.get(n) is None or probes[n].error is not None)
            for n, p in by_name.items()
        )
        if changes.admit or changes.revoke:
            token = self._token(ns, name)
            for pod_name, admit in [(n, True) for n in changes.admit] + [(n, False) for n in changes.revoke]:
                try:
                    self.replicas.admission(
                        self._url(by_name[pod_name], plan),
                        token,
                        AdmissionRequest(version=target, admit=admit),
                    )
                except ReplicaError as exc:
                    retry = True
                    log.info(
                        "%s/%s: %s of %s failed: %s",
                        ns,
                        name,
                        "admission" if admit else "eviction",
                        pod_name,
                        exc,
                    )
                    continue
                metrics.POD_ACTIONS.labels(action="admit" if admit else "evict").inc()
                log.info(
                    "%s/%s: %s %s at weights version %d",
                    ns,
                    name,
                    "admitted" if admit else "took the admission back from",
                    pod_name,
                    target,
                )
        if retry:
            self._retry_later((ns, name))

    def _mount_problems(self, key: Key, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Pod → the newest FailedMount Event's message, for Pods whose containers wait in
        ContainerCreating (the cause is only in their Events); such a model is looked at again
        shortly, since a Pod stuck that way sends no further event."""
        waiting = [p for p in pods if waits_for_mount(p)]
        if not waiting:
            return {}
        out: dict[str, str] = {}
        for pod in waiting:
            name = pod["metadata"]["name"]
            try:
                events = self.kube.list(
                    core_path("events", key[0]),
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={name},reason=FailedMount",
                )
            except KubeError as exc:  # the status then only says it waits; nothing else depends on it
                log.info("%s/%s: cannot read the Events of %s: %s", *key, name, exc)
                continue
            uid = pod["metadata"].get("uid")
            mine = [e for e in events if (e.get("involvedObject") or {}).get("uid") in (None, uid)]
            if mine:
                newest = max(mine, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
                out[name] = " ".join(str(newest.get("message") or "").split())
        self._retry_later(key, MOUNT_RECHECK_S)
        return out

    def _retry_later(self, key: Key, delay_s: float = ADMISSION_RETRY_S) -> None:
        with self._guard:
            if key in self._retry_pending:
                return
            self._retry_pending.add(key)

        def again() -> None:
            with self._guard:
                self._retry_pending.discard(key)
            self.request(key, "admission")

        self.later(delay_s, again)

    def _watch_peer_restore(self, key: Key, receivers: dict[str, str], target: int) -> None:
        """Reconcile the moment the receivers (pod → URL) of a peer restore serve ``target`` (or it
        ends otherwise), so they are admitted, and the next restore starts, at once rather than at
        the next resync."""

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

    def _restore(
        self,
        rm: Mapping[str, Any],
        plan: Plan,
        pods: list[dict[str, Any]],
        probes: Mapping[str, ProbeResult],
        stale: set[str],
        target: int,
    ) -> tuple[bool, tuple[str, ...]]:
        """Bring stale replicas to ``target``: saved weights first (``persistDir``, or the Pod's own
        copy after a container restart), else a healthy peer sends them.

        Returns (whether to look again at once: a replica was restored from disk, or a disk restore
        failed and a peer is next; the replicas nothing can restore: their weights are lost). A peer
        restore runs in the background and reconciles when it lands.
        """
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        by_name = {p["metadata"]["name"]: p for p in pods}
        now = time.monotonic()
        with self._guard:
            busy = {
                pod
                for (pns, pod), (ident, until) in self._restoring.items()
                if pns == ns and pod in by_name and ident == identity(by_name[pod]) and until > now
            }
        disk_failed = {
            pod
            for pod in stale
            if pod in by_name and self._restore_failed.get((ns, pod)) == identity(by_name[pod])
        }
        persist_dir = plan.spec.weight_sync.persist_dir
        pod_copies = (
            {n for n in stale if n in by_name and pod_restarts(by_name[n]) > 0}
            if plan.spec.weight_sync.pod_copy and not persist_dir
            else set()
        )
        todo = restore_plan(
            stale,
            probes,
            target,
            persisted=bool(persist_dir),
            disk_failed=disk_failed,
            busy=busy,
            pod_copies=pod_copies,
        )
        if not (todo.from_disk or todo.from_peer or todo.unrecoverable):
            return False, ()
        token = self._token(ns, name)
        restored = False
        for pod_name in todo.from_disk:
            pod = by_name[pod_name]
            try:
                self.replicas.restore_weights(
                    self._url(pod, plan),
                    token,
                    RestoreWeightsRequest(version=target, timeout_s=RESTORE_TIMEOUT_S),
                )
            except ReplicaError as exc:
                self._restore_failed[(ns, pod_name)] = identity(pod)
                restored = True  # not restored, but a peer is next: look again at once
                self._post_event(
                    rm,
                    Event(
                        "Warning",
                        "RestoreFailed",
                        restore_failed_message(pod_name, target, str(exc), persist_dir),
                    ),
                )
                continue
            restored = True
            metrics.POD_ACTIONS.labels(action="restore").inc()
            self._post_event(
                rm,
                Event(
                    "Normal",
                    "ReplicaRestored",
                    f"{pod_name} restored to weights version {target} from saved weights",
                ),
            )
        # Replicas whose disk restore failed just now go to a peer on the next pass.
        # One peer restore of a model at a time: its source sends to every receiver of it at once,
        # and would refuse a second send (409) until the first is done; the watcher of the one in
        # flight reconciles when it lands, which starts the next.
        if todo.peer_source is not None and todo.from_peer and not busy:
            source = by_name[todo.peer_source]
            receivers = [by_name[p] for p in todo.from_peer]
            group = f"{name}-peer-v{target}-{uuid.uuid4().hex[:6]}"
            try:
                restore_from_peer(
                    self.replicas,
                    token,
                    source_url=self._url(source, plan),
                    source_host=source["status"]["podIP"],
                    port=int(source["metadata"]["annotations"][ANNOTATION_GROUP_PORT]),
                    receivers=[
                        Receiver(p["metadata"]["name"], self._url(p, plan), plan.spec.tensor_parallel_size)
                        for p in receivers
                    ],
                    version=target,
                    timeout_s=RESTORE_TIMEOUT_S,
                    group_id=group,
                )
            except ReplicaError as exc:
                for p in receivers:
                    self._restoring[(ns, p["metadata"]["name"])] = (identity(p), now + PEER_RETRY_S)
                self._post_event(
                    rm,
                    Event(
                        "Warning",
                        "RestoreFailed",
                        f"copying weights version {target} from {todo.peer_source} to {', '.join(todo.from_peer)} "
                        f"failed: {exc}; retried in {PEER_RETRY_S:.0f}s (a full push also repairs them)",
                    ),
                )
            else:
                with self._guard:
                    for p in receivers:
                        self._restoring[(ns, p["metadata"]["name"])] = (identity(p), now + RESTORE_TIMEOUT_S)
                metrics.POD_ACTIONS.labels(action="peer-restore").inc()
                self._watch_peer_restore(
                    (ns, name), {p["metadata"]["name"]: self._url(p, plan) for p in receivers}, target
                )
                self._post_event(
                    rm,
                    Event(
                        "Normal",
                        "ReplicaRestoring",
                        f"{todo.peer_source} sends weights version {target} to {', '.join(todo.from_peer)}",
                    ),
                )
        for pod_name in todo.unrecoverable:
            if self._unrecoverable_told.get((ns, pod_name)) == identity(by_name[pod_name]):
                continue  # said once per replica start; the status keeps saying it
            self._unrecoverable_told[(ns, pod_name)] = identity(by_name[pod_name])
            self._post_event(
                rm,
                Event(
                    "Warning",
                    "RestoreFailed",
                    restore_failed_message(
                        pod_name,
                        target,
                        "no healthy replica serves that version to copy it from",
                        persist_dir,
                    ),
                ),
            )
        return restored, todo.unrecoverable

    def _token(self, ns: str, name: str) -> str:
        secret_name = token_secret_name(name)
        secret = (  # the index lags a Secret created moments ago
            self._reader().child(SECRETS, ns, secret_name)
            or self.kube.get(core_path("secrets", ns, secret_name))
            or {}
        )
        return base64.b64decode((secret.get("data") or {}).get(TOKEN_KEY, "")).decode()

    @staticmethod
    def _url(pod: Mapping[str, Any], plan: Plan) -> str:
        return f"http://{pod['status']['podIP']}:{plan.ports.http}"

    def cleanup(self, rm: Mapping[str, Any]) -> None:
        """What garbage collection cannot do when a RewardModel goes (the reason for the finalizer).

        Pods, Service, token Secret and NetworkPolicy carry owner references, so the garbage
        collector deletes them. GC follows owner references only: a WeightSync names its model in
        ``spec.rewardModelRef``, and one created without an owner reference (by kubectl, or an
        SDK older than this operator) would outlive the model, as would its manifest ConfigMap;
        those are deleted here. Then the operator drops its in-memory state of the model (stale
        replicas, restore bookkeeping), which no cluster object holds. With ``delete_children``
        (a control plane without a garbage collector) it deletes the owned children too.
        """
        ns, name = rm["metadata"]["namespace"], rm["metadata"]["name"]
        if self.delete_children:
            for plural in ("pods", "services", "secrets"):
                for child in self.kube.list(core_path(plural, ns), label_selector=selector(name)):
                    self.kube.delete(core_path(plural, ns, child["metadata"]["name"]))
            self.kube.delete(network_policy_path(ns, network_policy_name(name)))
        for cm in self.kube.list(core_path("configmaps", ns), label_selector=selector(name)):
            if self.delete_children or not _owned_by(cm, rm):
                self.kube.delete(core_path("configmaps", ns, cm["metadata"]["name"]))
        for ws in self.kube.list(custom_path(ns, plural=WS_PLURAL)):  # the model's pushes go with it
            if (ws.get("spec") or {}).get("rewardModelRef") == name and (
                self.delete_children or not _owned_by(ws, rm)
            ):
                self.kube.delete(custom_path(ns, ws["metadata"]["name"], WS_PLURAL))
        self.forget((ns, name))
