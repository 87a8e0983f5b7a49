"""What a reconcile reads about the cluster: the model itself, its Secret, Service and
NetworkPolicy, nodes, every RewardModel and rewardplane Pod (device accounting), a model's
WeightSyncs.

Listing those from the API server on every reconcile of every model costs O(models²) per resync
period. ``IndexedCluster`` reads kopf's in-memory indexes instead (``@kopf.index`` handlers in
``handlers.py``, kept current by kopf's watches), so a reconcile costs the same whatever the number
of models, and a resync of a model whose children are as planned makes no API call at all. An
index may lag the API server by a watch event: the reconciler only uses it for what a stale read
cannot harm (a create answered 409, a patch to what is already there) and re-reads before deleting.
``ApiCluster`` reads the API server: used before the indexes are attached, and by tests that run
the reconciler without kopf.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import LABEL_MODEL, WS_PLURAL

from .planning import NodeInfo, node_info

Key = tuple[str, str]  # (namespace, name) of a namespaced object: every operator module's key

# The children a reconcile ensures besides Pods, by plural; their indexes are keyed (namespace, name).
SECRETS, SERVICES, NETWORK_POLICIES = "secrets", "services", "networkpolicies"


def network_policy_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies"
    return path + (f"/{name}" if name else "")


def child_path(plural: str, namespace: str, name: str | None = None) -> str:
    if plural == NETWORK_POLICIES:
        return network_policy_path(namespace, name)
    return core_path(plural, namespace, name)


class ClusterReader(Protocol):
    def model(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def child(self, plural: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A Secret, Service or NetworkPolicy of a model: what the reconciler compares (see summary)."""
        ...

    def nodes(self) -> list[NodeInfo]: ...

    def models(self) -> list[Mapping[str, Any]]: ...

    def pods(self) -> list[Mapping[str, Any]]: ...

    def pods_of(self, namespace: str, model: str) -> list[dict[str, Any]]: ...

    def weightsyncs(self, namespace: str, model: str) -> list[Mapping[str, Any]]: ...


class ApiCluster:
    def __init__(self, kube: Kube, namespace: str | None) -> None:
        self.kube, self.namespace = kube, namespace

    def model(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get(custom_path(namespace, name))

    def child(self, plural: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.kube.get(child_path(plural, namespace, name))

    def nodes(self) -> list[NodeInfo]:
        return [node_info(n) for n in self.kube.list(core_path("nodes"))]

    def _cluster_wide(self, everywhere: str, here: str, selector: str | None = None) -> list[dict[str, Any]]:
        try:
            return self.kube.list(everywhere, label_selector=selector)
        except KubeError as exc:
            if exc.status != 403 or self.namespace is None:
                raise
            return self.kube.list(here, label_selector=selector)  # RBAC scoped to one namespace

    def models(self) -> list[Mapping[str, Any]]:
        return list(self._cluster_wide(custom_path(), custom_path(self.namespace)))

    def pods(self) -> list[Mapping[str, Any]]:
        return list(self._cluster_wide(core_path("pods"), core_path("pods", self.namespace), LABEL_MODEL))

    def pods_of(self, namespace: str, model: str) -> list[dict[str, Any]]:
        return self.kube.list(core_path("pods", namespace), label_selector=f"{LABEL_MODEL}={model}")

    def weightsyncs(self, namespace: str, model: str) -> list[Mapping[str, Any]]:
        return [
            w
            for w in self.kube.list(custom_path(namespace, plural=WS_PLURAL))
            if (w.get("spec") or {}).get("rewardModelRef") == model
        ]


def _values(index: Mapping[Any, Iterable[Any]], key: Any = None) -> list[Any]:
    """A snapshot of an index (or of one key's store). kopf updates indexes on its event loop
    while reconciles read them from worker threads: retry the copy if it changed meanwhile."""
    for _ in range(5):
        try:
            if key is not None:
                return list(index[key]) if key in index else []
            return [v for k in list(index) for v in list(index.get(k, ()))]
        except RuntimeError:  # "changed size during iteration"
            continue
    return []


Index = Mapping[Any, Iterable[Any]]


class IndexedCluster:
    """Reads kopf's indexes: ``nodes`` (name → NodeInfo), ``models`` ((ns, name) → body),
    ``pods`` ((ns, model) → body), ``weightsyncs`` ((ns, model) → body), and ``children``
    (plural → index of (ns, name) → ``summary``) for the Secrets, Services and NetworkPolicies."""

    def __init__(
        self,
        nodes: Index,
        models: Index,
        pods: Index,
        weightsyncs: Index,
        children: Mapping[str, Index],
    ) -> None:
        self._nodes, self._models, self._pods, self._ws = nodes, models, pods, weightsyncs
        self._children = children

    def model(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = _values(self._models, (namespace, name))
        return found[0] if found else None

    def child(self, plural: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        found = _values(self._children[plural], (namespace, name))
        return found[0] if found else None

    def nodes(self) -> list[NodeInfo]:
        return sorted(_values(self._nodes), key=lambda n: n.name)

    def models(self) -> list[Mapping[str, Any]]:
        return _values(self._models)

    def pods(self) -> list[Mapping[str, Any]]:
        return _values(self._pods)

    def pods_of(self, namespace: str, model: str) -> list[dict[str, Any]]:
        return _values(self._pods, (namespace, model))

    def weightsyncs(self, namespace: str, model: str) -> list[Mapping[str, Any]]:
        return _values(self._ws, (namespace, model))


def plain(body: Mapping[str, Any]) -> dict[str, Any]:
    """A detached copy of a kopf body, safe to keep in an index and read from other threads;
    without metadata.managedFields (server-side apply bookkeeping no reconcile reads, often the
    largest part of a Pod)."""
    out = copy.deepcopy(dict(body))
    if isinstance(out.get("metadata"), dict):
        out["metadata"].pop("managedFields", None)
    return out


def summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the reconciler reads of a child (name, spec, a Secret's data): a detached copy without
    managedFields, status and annotations, so 1000 models' children cost little memory."""
    meta = body.get("metadata") or {}
    out: dict[str, Any] = {
        "metadata": {k: meta[k] for k in ("name", "namespace", "resourceVersion") if k in meta}
    }
    for field in ("spec", "data"):
        if field in body:
            out[field] = copy.deepcopy(body[field])
    return out


def _revision(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def freshest(indexed: dict[str, Any] | None, written: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model as the index holds it, unless the reconciler's own last status write (the object
    the PATCH answered) is newer: the index lags that write by a watch event, and comparing the next
    status with the older one would write it twice and post its Events twice. The API server's
    resourceVersions are etcd revisions (integers); anything else, or a model gone from the index,
    and the index wins; so does another object of the same name (deleted and created again)."""
    if indexed is None or written is None:
        return indexed
    if indexed["metadata"].get("uid") != written["metadata"].get("uid"):
        return indexed
    mine, theirs = _revision(written), _revision(indexed)
    if mine is not None and theirs is not None and mine > theirs:
        return written
    return indexed
