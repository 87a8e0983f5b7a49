"""What a reconcile reads about the rest of the cluster: nodes, every RewardModel and rewardplane Pod
(device accounting), a model's WeightSyncs.

Listing those from the API server on every reconcile of every model costs O(models²) per resync
period. ``IndexedCluster`` reads kopf's in-memory indexes instead (``@kopf.index`` handlers in
``handlers.py``, kept current by kopf's watches), so a reconcile costs the same whatever the number
of models. ``ApiCluster`` lists from the API server: used before the indexes are attached, and
by tests that run the reconciler without kopf.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import LABEL_MODEL, WS_PLURAL

from .planning import NodeInfo, node_info

Key = tuple[str, str]


class ClusterReader(Protocol):
    def nodes(self) -> list[NodeInfo]: ...

    def models(self) -> list[Mapping[str, Any]]: ...

    def pods(self) -> list[Mapping[str, Any]]: ...

    def pods_of(self, namespace: str, model: str) -> list[dict[str, Any]]: ...

    def weightsyncs(self, namespace: str, model: str) -> list[Mapping[str, Any]]: ...


class ApiCluster:
    def __init__(self, kube: Kube, namespace: str | None) -> None:
        self.kube, self.namespace = kube, namespace

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


class IndexedCluster:
    """Reads kopf's indexes: ``nodes`` (name → NodeInfo), ``models`` ((ns, name) → body),
    ``pods`` ((ns, model) → body), ``weightsyncs`` ((ns, model) → body)."""

    def __init__(
        self,
        nodes: Mapping[Any, Iterable[Any]],
        models: Mapping[Any, Iterable[Any]],
        pods: Mapping[Any, Iterable[Any]],
        weightsyncs: Mapping[Any, Iterable[Any]],
    ) -> None:
        self._nodes, self._models, self._pods, self._ws = nodes, models, pods, weightsyncs

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
    """A detached copy of a kopf body, safe to keep in an index and read from other threads."""
    return copy.deepcopy(dict(body))
