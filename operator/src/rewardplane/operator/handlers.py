"""kopf handlers, kept thin: each one names a trigger and hands the object to the Reconciler.

The Reconciler (``memo.reconciler``, set up by ``python -m rewardplane.operator``) reads the
cluster, plans with the pure modules and applies the result. Handlers never raise for a bad spec
(that ends in a Degraded condition and a Warning event) and API errors are retried by the resync
timer, so neither makes kopf retry in a storm.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import kopf

from rewardplane.api.names import FINALIZER, GROUP, LABEL_MODEL, VERSION, WS_PLURAL
from rewardplane.api.names import RM_PLURAL as PLURAL
from rewardplane.protocol import settings

from . import metrics
from .cluster import NETWORK_POLICIES, SECRETS, SERVICES, IndexedCluster, plain, summary
from .planning import NodeInfo, node_info
from .pods import watched_state

RESOURCE = (GROUP, VERSION, PLURAL)
# How often every RewardModel is re-checked besides its events (spec changes, Pod changes, pushes
# finished): catches what no event announces (a server that turned broken, an API error to retry).
# A resync reads kopf's indexes and probes each ready replica; it calls the API server only when
# something differs from the plan. 1000 models at 30 s is ~33 reconciles per second
# (benchmarks/README.md). ``--resync-interval``, else REWARDPLANE_RESYNC_INTERVAL (docs/settings.md).
RESYNC_INTERVAL_S = settings.RESYNC_INTERVAL.get()
# Pushes run in handler threads for as long as a transfer lasts; reconciles need threads meanwhile.
EXECUTOR_THREADS = 32
RESYNC_THREADS = 4
_RESYNC_POOL = ThreadPoolExecutor(RESYNC_THREADS, thread_name_prefix="resync")


def _key(body: Any) -> tuple[str, str]:
    return body["metadata"]["namespace"], body["metadata"]["name"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.execution.max_workers = EXECUTOR_THREADS
    settings.posting.level = logging.WARNING  # our own Events carry the transitions
    settings.watching.server_timeout = 300  # re-list every 5 minutes at most
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # A deleted RewardModel waits until its resync timer's current run returns; kopf re-checks only
    # every 60 s by default, so a delete that lands mid-reconcile would take a minute.
    settings.background.cancellation_polling = 0.5


# kopf's own HTTP client has no limit on its pool: it opens a connection per concurrent request and
# keeps each one. After a burst of creates that was a TLS connection per model, each holding
# ~128 KiB of buffers (a quarter of the RSS at 1000 models, benchmarks/README.md). Bounded here,
# with room for the long-lived watch streams (~10) beside the patches.
KOPF_CONNECTIONS = 32


@kopf.on.login()
async def login(memo: kopf.Memo, **_: Any) -> kopf.AiohttpSession:
    # One source of credentials for kopf and our own client: what --kubeconfig (or in-cluster) says.
    info = kopf.ConnectionInfo(**memo.reconciler.kube.connection_details())
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=KOPF_CONNECTIONS, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(),
    )
    return kopf.AiohttpSession(server=info.server, aiohttp_session=session)


# ------------------------------------------------------------------------------ indexes
# What reconciles read about the rest of the cluster, kept in memory by kopf's watches (see
# cluster.py): a reconcile then costs the same whatever the number of models.


@kopf.index("v1", "nodes")
def nodes_by_name(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeInfo]:
    return {name: node_info(plain(body))}


@kopf.index(*RESOURCE)
def models_by_key(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    return {(namespace or "", name): plain(body)}


@kopf.index("v1", "pods", labels={LABEL_MODEL: kopf.PRESENT})
def pods_by_model(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Any]:
    return {(namespace or "", labels[LABEL_MODEL]): plain(body)}


# The Secret, Service and NetworkPolicy of every model, so a resync compares them with the plan
# without a GET each (4 GETs per model every 30 s kept the API server busy at 1000 models).


def _child_key(namespace: str | None, name: str) -> tuple[str, str]:
    return (namespace or "", name)


@kopf.index("v1", SECRETS, labels={LABEL_MODEL: kopf.PRESENT})
def secrets_by_name(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Any]:
    return {_child_key(namespace, name): summary(body)}


@kopf.index("v1", SERVICES, labels={LABEL_MODEL: kopf.PRESENT})
def services_by_name(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Any]:
    return {_child_key(namespace, name): summary(body)}


@kopf.index("networking.k8s.io", "v1", NETWORK_POLICIES, labels={LABEL_MODEL: kopf.PRESENT})
def network_policies_by_name(
    namespace: str | None, name: str, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Any]:
    return {_child_key(namespace, name): summary(body)}


def _attach(memo: kopf.Memo, kwargs: dict[str, Any]) -> None:
    if memo.reconciler.cluster is None:
        memo.reconciler.cluster = IndexedCluster(
            kwargs["nodes_by_name"],
            kwargs["models_by_key"],
            kwargs["pods_by_model"],
            kwargs["weightsyncs_by_model"],
            {
                SECRETS: kwargs["secrets_by_name"],
                SERVICES: kwargs["services_by_name"],
                NETWORK_POLICIES: kwargs["network_policies_by_name"],
            },
        )


# ------------------------------------------------------------------------------ RewardModel


@kopf.on.create(*RESOURCE, id="reconcile")
@kopf.on.update(*RESOURCE, id="reconcile")
@kopf.on.resume(*RESOURCE, id="reconcile")
def reconcile_on_change(body: kopf.Body, memo: kopf.Memo, reason: str, **kwargs: Any) -> None:
    _attach(memo, kwargs)
    memo.reconciler.request(_key(body), trigger=str(reason))


@kopf.timer(*RESOURCE, id="resync", interval=RESYNC_INTERVAL_S, initial_delay=RESYNC_INTERVAL_S)
async def resync(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    _attach(memo, kwargs)
    # On threads of their own: at 1000 models the resyncs filled kopf's executor and a new model's
    # first reconcile queued behind hundreds of them (apply → Pods over 30 s, benchmarks/README.md).
    # When they cannot keep up, each model's next tick simply comes later.
    metrics.QUEUE_DEPTH.inc()  # until a resync thread takes it
    await asyncio.wrap_future(_RESYNC_POOL.submit(_resync_now, memo.reconciler, _key(body)))


def _resync_now(reconciler: Any, key: tuple[str, str]) -> None:
    metrics.QUEUE_DEPTH.dec()
    reconciler.request(key, "timer")


@kopf.on.delete(*RESOURCE, id="cleanup")
def cleanup(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.cleanup(body)


@kopf.on.event("v1", "pods", labels={LABEL_MODEL: kopf.PRESENT})
def pod_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    """React at once when a replica goes, comes or changes readiness, instead of at the next tick."""
    meta = body["metadata"]
    state = None if type == "DELETED" else watched_state(body)
    if not memo.reconciler.pod_state_changed((meta["namespace"], meta["name"]), state):
        return  # status heartbeats of an unchanged Pod: nothing to do
    _attach(memo, kwargs)
    memo.reconciler.request((meta["namespace"], meta["labels"][LABEL_MODEL]), trigger="pod")


@kopf.on.event("v1", SERVICES, labels={LABEL_MODEL: kopf.PRESENT})
def service_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **kwargs: Any) -> None:
    """A model's Service edited (its ports or selector) or deleted by hand: put back at once
    instead of at the next tick."""
    meta, spec = body["metadata"], body.get("spec") or {}
    state = None if type == "DELETED" else (repr(spec.get("ports")), repr(spec.get("selector")))
    if not memo.reconciler.service_state_changed((meta["namespace"], meta["name"]), state):
        return
    _attach(memo, kwargs)
    memo.reconciler.request((meta["namespace"], meta["labels"][LABEL_MODEL]), trigger="service")


# ------------------------------------------------------------------------------ WeightSync
# A WeightSync asks for one push; the driver (memo.weightsyncs) runs it in the handler: kopf
# handles one object at a time, so a generation arriving during a push is handled right after it.

WS_RESOURCE = (GROUP, VERSION, WS_PLURAL)


@kopf.index(*WS_RESOURCE)
def weightsyncs_by_model(
    namespace: str | None, spec: kopf.Spec, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], Any]:
    return {(namespace or "", str(spec.get("rewardModelRef", ""))): plain(body)}


@kopf.on.create(*WS_RESOURCE, id="push")
@kopf.on.update(*WS_RESOURCE, id="push", field="spec")
def weightsync_changed(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    _attach(memo, kwargs)
    memo.weightsyncs.handle(_key(body))


@kopf.on.event(*WS_RESOURCE)
def weightsync_event(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":  # no finalizer: the object is gone, its last state is in the event
        memo.weightsyncs.deleted(plain(body))


@kopf.on.resume(*WS_RESOURCE, id="resume")
def weightsync_resumed(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    _attach(memo, kwargs)
    # A push that was running when the operator stopped cannot be picked up again (the trainer's
    # group is gone with it): marked Failed with reason OperatorRestarted; the trainer pushes again.
    memo.weightsyncs.handle(_key(body))
