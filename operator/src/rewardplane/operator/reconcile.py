"""Read → plan → apply for one RewardModel, and cleanup on delete.

Everything decided here comes from the pure modules (planning, render, status, recovery); the
reconciler reads the cluster and drives the parts that write to it: the children
(:mod:`.children`), the status and Events (:mod:`.reporting`), the restores of stale replicas
(:mod:`.restoring`) and the reads of why Pods wait (:mod:`.waiting`). It admits replicas at the
model's weights version itself. Reconciles of one model are coalesced: a request arriving while
one runs makes it run once more, never twice at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import httpx

from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.spec import GpuMode, InvalidSpecError
from rewardplane.protocol import AdmissionRequest, settings

from . import metrics
from .children import Children
from .cluster import ApiCluster, ClusterReader, Key, plain
from .coalesce import Coalescer
from .conditions import compute_status
from .ownership import of_model
from .planning import ClusterView, Plan, gpus_in_use, plan_reward_model
from .pods import pod_ready, replica_index, server_started
from .recovery import Identity, ReplicaView, admission_changes, replica_url, stale_replicas
from .render import ANNOTATION_SPEC_HASH, render_children, selector
from .replicas import HttpReplicas, ReplicaError, Replicas
from .reporting import StatusWriter, now_rfc3339, post_event
from .restoring import Later, Restorer
from .retire import Retirement
from .rollout import pod_actions
from .status import Event, ProbeResult
from .storage import ModelCache
from .waiting import PodWaits
from .weightsync import completed_version

log = logging.getLogger("rewardplane.operator")

# A started replica that could not be probed or admitted yet is looked at again this soon (its Pod
# sends no further event until it is Ready, which needs the admission).
ADMISSION_RETRY_S = 1.0


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
        default_image: str | None = None,
        model_cache: ModelCache | None = None,
    ) -> None:
        self.kube = kube
        # Where replicas keep downloaded models on the nodes (--model-cache-dir, --model-cache-size).
        self.model_cache = model_cache or ModelCache()
        # The reward-server image of a model without spec.engine.image (--default-server-image);
        # None: such a model is Degraded (NoImage) and gets no Pods.
        self.default_image = default_image
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
        self.children = Children(kube, self._reader)
        self.status_writer = StatusWriter(kube, settings.RESYNC_INTERVAL.get())
        self.retirement = Retirement(kube, lambda: [n.name for n in self._reader().nodes()], default_image)
        self.restorer = Restorer(
            self.replicas,
            token=self.children.token,
            post_event=self._post_event,
            request=self.request,
            later=later,
        )
        self.waits = PodWaits(kube, self._retry_later)  # why Pods wait, for the status
        self._guard = threading.Lock()
        self._coalesce: Coalescer[Key] = Coalescer(on_waiting=metrics.QUEUE_DEPTH.inc)
        self._pod_states: dict[Key, object] = {}
        self._service_states: dict[Key, object] = {}
        self._stale: dict[Key, set[str]] = {}
        self._serving: dict[Key, dict[str, Identity]] = {}  # pod → identity last seen on the model's version
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
            if isinstance(exc, KubeError) and exc.status == 403 and "is being terminated" in str(exc):
                # not a permission: the namespace is being deleted, and its children with it
                result = "gone"
                log.info("%s/%s: its namespace is being deleted; nothing to reconcile: %s", *key, exc)
            elif isinstance(exc, KubeError) and exc.status == 403:
                log.error(
                    "reconcile of %s/%s forbidden: the operator's ServiceAccount lacks a permission "
                    "(the chart's ClusterRole and ClusterRoleBinding grant what it needs); retrying on "
                    "the next timer tick: %s",
                    *key,
                    exc,
                )
            else:
                log.warning("reconcile of %s/%s failed, retrying on the next timer tick: %s", *key, exc)
        finally:
            metrics.DURATION.observe(time.perf_counter() - started)
            metrics.RECONCILES.labels(trigger=trigger, result=result).inc()

    def _remember(self, seen: dict[Key, object], key: Key, state: object | None) -> object:
        """Keep ``state`` for ``key`` (None: gone); returns what was kept before (``...``: never seen)."""
        with self._guard:
            before = seen.get(key, ...)
            if state is None:
                seen.pop(key, None)
            else:
                seen[key] = state
            return before

    def pod_state_changed(self, pod: Key, state: object | None) -> bool:
        """Remember what matters of a Pod (None: deleted); True when it differs from last time."""
        return self._remember(self._pod_states, pod, state) != state

    def service_state_changed(self, service: Key, state: object | None) -> bool:
        """Remember a Service's ports and selector (None: deleted); True when they changed since
        they were last seen. The first sight is no change: every model is reconciled at start."""
        before = self._remember(self._service_states, service, state)
        return before is not ... and before != state

    def stale_pods(self, key: Key) -> set[str]:
        """Pods of the model that restarted onto older weights and wait for (or undergo) a restore."""
        with self._guard:
            return set(self._stale.get(key, ()))

    def forget(self, key: Key) -> None:
        self.status_writer.forget(key)
        self._stale.pop(key, None)
        self._serving.pop(key, None)

    def cleanup(self, rm: Mapping[str, Any]) -> None:
        """Retire a deleted RewardModel before its finalizer goes, so that an object created again
        under its name starts clean (the reason for the finalizer): its Pods deleted and waited
        for (their graceful drain, seconds), every child deleted now rather than by garbage
        collection later (the next object of the name would find the old token Secret and
        Service, which the collector then deletes under it), the weights it persisted removed from
        every node, and the operator's in-memory state of the model forgotten."""
        rm = plain(rm)  # a kopf body is a view; the wipe Pod is built from plain values
        self.retirement.pods_gone(rm)
        self.children.delete_unowned(rm, delete_children=True)
        try:
            self.retirement.wipe(rm)
        except KubeError as exc:  # never holds the model's deletion: the log names what is left
            log.warning("%s/%s: its persisted weights were not wiped: %s", *self._key_of(rm), exc)
        self.forget((rm["metadata"]["namespace"], rm["metadata"]["name"]))

    # ---------------------------------------------------------------- read

    @staticmethod
    def _key_of(rm: Mapping[str, Any]) -> Key:
        return rm["metadata"]["namespace"], rm["metadata"]["name"]

    def _reader(self) -> ClusterReader:
        return self.cluster or ApiCluster(self.kube, self.namespace)

    def _model(self, key: Key) -> dict[str, Any] | None:
        if self.cluster is None:
            return self.kube.get(custom_path(*key))
        return self.status_writer.fresher(key, self.cluster.model(*key))

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
            results[pod["metadata"]["name"]] = self.replicas.probe(replica_url(pod, plan))
        return results

    # ---------------------------------------------------------------- status and events

    def _write_status(self, rm: Mapping[str, Any], status: dict[str, Any]) -> None:
        self.status_writer.write(rm, status, remember=self.cluster is not None)

    def _post_event(self, rm: Mapping[str, Any], event: Event) -> None:
        post_event(self.kube, rm, event)

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
        # Only this object's: a model deleted and created again under the same name must not take
        # the weights version of the old object's Pods, which may still be terminating.
        pods = of_model(cluster.pods_of(ns, name), rm)
        try:
            plan = self._plan(rm, pods)
            desired, service = render_children(rm, plan)
            if self.cluster is not None and pod_actions(desired, pods, datetime.now(UTC)).delete:
                pods = of_model(self.kube.list(core_path("pods", ns), label_selector=selector(name)), rm)
                plan = self._plan(rm, pods)
                desired, service = render_children(rm, plan)
        except InvalidSpecError as exc:
            # Leave running children alone (a typo must not take a model down) and say what to fix.
            status = compute_status(
                rm, None, pods, {}, now_rfc3339(), errors=exc.errors, error_reason=exc.reason
            )
            self._write_status(rm, status)
            return "invalid"
        self.children.ensure_secret(rm)
        self.children.ensure_service(ns, service)
        self.children.ensure_network_policy(rm, plan)
        after = self.children.apply_pods(ns, desired, pods)
        if after is None:
            pods = of_model(self.kube.list(core_path("pods", ns), label_selector=selector(name)), rm)
        else:
            pods = after
        hashes = {p["metadata"]["name"]: p["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for p in desired}
        known = completed_version(of_model(cluster.weightsyncs(ns, name), rm), name)
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
        view = ReplicaView(rm, plan, live, probes, stale, target)
        self._admit(view)
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
        restored, lost = self.restorer.restore(view) if stale else (False, ())
        status = compute_status(
            rm,
            plan,
            pods,
            probes,
            now_rfc3339(),
            desired_hashes=hashes,
            target_version=target,
            stale_pods=stale,
            mount_problems=self.waits.mount_problems(key, live),
            lost_pods=lost,
            downloads=self.waits.download_progress(key, live),
        )
        self._write_status(rm, status)
        if restored:
            self._coalesce.mark_dirty(key)  # re-read the restored replicas (or try a peer) right away
        return "ok"

    def _plan(self, rm: dict[str, Any], pods: list[dict[str, Any]]) -> Plan:
        return plan_reward_model(
            rm, self._cluster_view(rm, pods), default_image=self.default_image, model_cache=self.model_cache
        )

    def _admit(self, view: ReplicaView) -> None:
        """Admit the replicas that serve the target version and take the admission back from stale
        ones; the kubelet's next readiness probe moves them in or out of the Service's endpoints. A
        started replica not admitted yet (no answer, or a refused admission) is looked at again
        shortly."""
        ns, name = view.key
        by_name, probes, target = view.by_name, view.probes, view.target
        changes = admission_changes({n: p for n, p in probes.items() if n in by_name}, target, view.stale)
        retry = any(
            server_started(p) and not pod_ready(p) and (probes.get(n) is None or probes[n].error is not None)
            for n, p in by_name.items()
        )
        if changes.admit or changes.revoke:
            token = self.children.token(ns, name)
            for pod_name, admit in [(n, True) for n in changes.admit] + [(n, False) for n in changes.revoke]:
                try:
                    self.replicas.admission(
                        view.url(by_name[pod_name]), token, AdmissionRequest(version=target, admit=admit)
                    )
                except ReplicaError as exc:
                    retry = True
                    what = "admission" if admit else "eviction"
                    log.info("%s/%s: %s of %s failed: %s", ns, name, what, pod_name, exc)
                    continue
                metrics.POD_ACTIONS.labels(action="admit" if admit else "evict").inc()
                done = "admitted" if admit else "took the admission back from"
                log.info("%s/%s: %s %s at weights version %d", ns, name, done, pod_name, target)
        if retry:
            self._retry_later(view.key)

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
