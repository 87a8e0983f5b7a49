"""The reconciler on kopf's indexes: which API calls a create and a resync make, and that reads
from an index (which lags the API server by a watch event) change nothing users see."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rewardplane.api.kube import core_path, custom_path
from rewardplane.operator.cluster import (
    NETWORK_POLICIES,
    SECRETS,
    SERVICES,
    IndexedCluster,
    freshest,
    plain,
    summary,
)
from rewardplane.operator.planning import node_info
from rewardplane.operator.reconcile import Reconciler
from rewardplane.testing.kube import MemoryKube
from rewardplane.testing.replicas import FakeReplicas

from .test_planning import cpu_rm

NS = "default"


class CountingKube(MemoryKube):
    """MemoryKube that numbers writes with resourceVersions (as etcd revisions) and records calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._revision = 0

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        return obj

    def put(self, collection: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._stamp(super().put(collection, body))

    def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("GET", path))
        return super().get(path)

    def list(
        self, path: str, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        self.calls.append(("LIST", path))
        return super().list(path, label_selector, field_selector)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("POST", path.rsplit("/", 1)[-1]))
        return super().create(path, body)

    def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        key = path.removesuffix("/status")
        out = super().merge_patch(path, body)
        self._stamp(self.objects[key])
        out["metadata"]["resourceVersion"] = self.objects[key]["metadata"]["resourceVersion"]
        return out

    def delete(self, path: str) -> bool:
        self.calls.append(("DELETE", path))
        return super().delete(path)


def snapshot(kube: MemoryKube) -> IndexedCluster:
    """The indexes kopf would hold once its watches have seen every object in ``kube``."""
    nodes: dict[Any, list[Any]] = {}
    models: dict[Any, list[Any]] = {}
    pods: dict[Any, list[Any]] = {}
    children: dict[str, dict[Any, list[Any]]] = {SECRETS: {}, SERVICES: {}, NETWORK_POLICIES: {}}
    for path, obj in kube.objects.items():
        meta = obj["metadata"]
        plural = path.rsplit("/", 2)[-2]
        if plural == "nodes":
            nodes[meta["name"]] = [node_info(obj)]
        elif plural == "rewardmodels":
            models[(meta["namespace"], meta["name"])] = [plain(obj)]
        elif plural == "pods":
            model = meta["labels"]["rewardplane.io/model"]
            pods.setdefault((meta["namespace"], model), []).append(plain(obj))
        elif plural in children:
            children[plural][(meta["namespace"], meta["name"])] = [summary(obj)]
    return IndexedCluster(nodes, models, pods, {}, children)


def setup() -> tuple[CountingKube, Reconciler]:
    kube = CountingKube()
    kube.put(core_path("nodes"), {"metadata": {"name": "cpu-a"}})
    kube.put(custom_path(NS), cpu_rm())
    reconciler = Reconciler(kube, replicas=FakeReplicas())  # type: ignore[arg-type]
    reconciler.cluster = snapshot(kube)
    return kube, reconciler


def test_a_new_model_is_created_without_a_single_read() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    # The index says what exists; a create of something that exists would be a harmless 409.
    assert [c for c in kube.calls if c[0] in ("GET", "LIST")] == []
    assert ("POST", "pods") in kube.calls
    assert kube.calls.count(("PATCH", custom_path(NS, "rm") + "/status")) == 1
    assert kube.get(core_path("pods", NS, "rm-0")) is not None
    status = (kube.get(custom_path(NS, "rm")) or {})["status"]
    assert status["replicas"] == 1  # the created Pod counted without re-listing


def test_a_resync_with_nothing_changed_calls_no_api() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    reconciler.cluster = snapshot(kube)  # the watches caught up
    kube.calls.clear()
    reconciler.reconcile((NS, "rm"))
    assert kube.calls == []


def test_a_stale_index_after_our_status_write_writes_and_tells_nothing_twice() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))  # the index still holds the model without status
    events = [p for p in kube.objects if "/events/" in p]
    kube.calls.clear()
    reconciler.reconcile((NS, "rm"))
    assert not [c for c in kube.calls if c[0] == "PATCH"]
    assert [p for p in kube.objects if "/events/" in p] == events


def test_a_spec_change_newer_than_our_write_is_read_from_the_index() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    kube.merge_patch(custom_path(NS, "rm"), {"spec": {"replicas": 2}})
    reconciler.cluster = snapshot(kube)
    reconciler.reconcile((NS, "rm"))
    assert kube.get(core_path("pods", NS, "rm-1")) is not None


def test_a_child_deleted_by_hand_comes_back_on_the_next_resync() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    kube.delete(core_path("services", NS, "rm"))
    reconciler.cluster = snapshot(kube)
    reconciler.reconcile((NS, "rm"))
    assert kube.get(core_path("services", NS, "rm")) is not None


def test_a_service_edited_by_hand_is_put_back_at_its_event() -> None:
    """The Service's event triggers the reconcile (not the next resync): its first sight at the
    operator's start does not, an edit of its ports or selector does, and so does its deletion;
    the reconcile puts the selector and ports back."""
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    svc = kube.get(core_path("services", NS, "rm")) or {}
    key = (NS, "rm")

    def state(obj: Mapping[str, Any]) -> tuple[str, str]:
        return repr(obj["spec"].get("ports")), repr(obj["spec"].get("selector"))

    assert not reconciler.service_state_changed(key, state(svc))  # seen at start
    assert not reconciler.service_state_changed(key, state(svc))  # a heartbeat, nothing edited
    kube.merge_patch(core_path("services", NS, "rm"), {"spec": {"selector": {"app": "other"}}})
    edited = kube.get(core_path("services", NS, "rm")) or {}
    assert reconciler.service_state_changed(key, state(edited))
    reconciler.cluster = snapshot(kube)
    reconciler.reconcile(key)
    assert (kube.get(core_path("services", NS, "rm")) or {})["spec"]["selector"] == svc["spec"]["selector"]
    assert reconciler.service_state_changed(key, None)  # deleted


def test_a_deletion_is_decided_on_a_fresh_list() -> None:
    kube, reconciler = setup()
    reconciler.reconcile((NS, "rm"))
    reconciler.cluster = snapshot(kube)
    kube.merge_patch(custom_path(NS, "rm"), {"spec": {"replicas": 0}})
    reconciler.cluster = snapshot(kube)
    kube.calls.clear()
    reconciler.reconcile((NS, "rm"))
    first_delete = next(i for i, c in enumerate(kube.calls) if c[0] == "DELETE")
    assert ("LIST", core_path("pods", NS)) in kube.calls[:first_delete]
    assert kube.get(core_path("pods", NS, "rm-0")) is None


def test_freshest_prefers_the_newer_revision_and_the_index_when_unsure() -> None:
    def at(rv: str | None) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": rv} if rv else {}}

    indexed, written = at("7"), at("9")
    assert freshest(indexed, written) is written
    assert freshest(at("10"), written)["metadata"]["resourceVersion"] == "10"  # type: ignore[index]
    assert freshest(at("9"), written) is not written  # caught up: the index again
    assert freshest(at(None), written)["metadata"] == {}  # type: ignore[index]
    assert freshest(None, written) is None  # gone from the index: gone
    assert freshest(indexed, None) is indexed


def test_index_copies_leave_out_what_no_reconcile_reads() -> None:
    body = {
        "metadata": {"name": "s", "namespace": NS, "resourceVersion": "3", "managedFields": [{"big": 1}]},
        "spec": {"ports": [{"port": 1}]},
        "data": {"token": "dA=="},
        "status": {"x": 1},
    }
    kept = summary(body)
    assert kept == {
        "metadata": {"name": "s", "namespace": NS, "resourceVersion": "3"},
        "spec": {"ports": [{"port": 1}]},
        "data": {"token": "dA=="},
    }
    kept["spec"]["ports"].append({"port": 2})
    assert len(body["spec"]["ports"]) == 1  # detached
    assert "managedFields" not in plain(body)["metadata"] and body["metadata"]["managedFields"]


def test_kopfs_client_pools_a_bounded_number_of_connections() -> None:
    """kopf's built-in client kept one TLS connection per model after a burst of creates."""
    import asyncio
    from types import SimpleNamespace

    import kopf

    from rewardplane.operator import handlers

    details = {"server": "https://127.0.0.1:6443", "insecure": True, "scheme": "Bearer", "token": "t"}
    memo = SimpleNamespace(
        reconciler=SimpleNamespace(kube=SimpleNamespace(connection_details=lambda: details))
    )

    async def login() -> tuple[kopf.AiohttpSession, int | None]:
        info = await handlers.login(memo=memo)  # type: ignore[arg-type]
        connector = info.aiohttp_session.connector
        limit = connector.limit if connector is not None else None
        await info.aiohttp_session.close()
        return info, limit

    info, limit = asyncio.run(login())
    assert info.server == details["server"] and limit == handlers.KOPF_CONNECTIONS
    assert info.aiohttp_session.headers["Authorization"] == "Bearer t"
