"""One operator at a time: a ``coordination.k8s.io`` Lease held by the operator that acts.

A Deployment's ``Recreate`` strategy does not cover a deleted Pod: its replacement starts while the
old operator still finishes its handlers. So an operator acts only while it holds the Lease
``rewardplane-operator`` in its own namespace (the election of the ``kubernetes`` package: the
holder renews every ``RETRY_PERIOD_S``; a candidate takes over once the holder gave the Lease up or
let it lapse for ``LEASE_DURATION_S``). An operator that cannot renew within ``RENEW_DEADLINE_S``
exits at once, before anyone else may take over, so a handler that lost the leadership writes
nothing more; the kubelet starts it again as a candidate. A clean stop (SIGTERM: kopf finishes its
handlers first) gives the Lease up, so the successor starts within one retry period.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("rewardplane.operator")

LEASE_NAME = "rewardplane-operator"
LEASE_DURATION_S = 15
RENEW_DEADLINE_S = 10
RETRY_PERIOD_S = 2
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def own_namespace(explicit: str | None) -> str | None:
    """The namespace of the Lease: the flag, else the Pod's (``POD_NAMESPACE``, or the mounted
    ServiceAccount's); None for an operator run outside a cluster without the flag."""
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return NAMESPACE_FILE.read_text().strip() or None
    except OSError:
        return None


def identity() -> str:
    """Unique per process: the Pod's name (its hostname) and the pid, so a restarted container
    never mistakes its predecessor's Lease for its own."""
    return f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"


class Leadership:
    """Blocks in :meth:`acquire` until this process leads; calls ``on_lost`` (default: exit) when
    the Lease cannot be renewed; :meth:`release` gives it up on a clean stop."""

    def __init__(
        self,
        configuration: Any,
        namespace: str,
        *,
        name: str = LEASE_NAME,
        on_lost: Callable[[], None] | None = None,
        owner_deployment: str | None = None,
    ) -> None:
        from kubernetes import client
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        class ReleasableLeaseLock(LeaseLock):
            """A LeaseLock that stops renewing once released (the election thread would otherwise
            take the Lease back right after the release)."""

            released = False
            led = False  # set once this process led: a Lease deleted since is not made again

            def update(self, name: str, namespace: str, updated_record: Any) -> bool:
                return False if self.released else bool(super().update(name, namespace, updated_record))

            def create(self, name: str, namespace: str, election_record: Any) -> bool:
                # Deleted under a leader: its owner (the Deployment) went, or someone removed it.
                # Not re-made: renewing fails, this operator stops, and a new candidate starts over.
                if self.released or self.led:
                    return False
                return bool(super().create(name, namespace, election_record))

        self.identity = identity()
        self.namespace, self.name = namespace, name
        self._lock = ReleasableLeaseLock(name, namespace, self.identity)
        self._lock.api_instance = client.CoordinationV1Api(client.ApiClient(configuration))
        self._leading = threading.Event()
        self._on_lost = on_lost or self._exit
        self._owner_deployment = owner_deployment
        self._configuration = configuration
        config = electionconfig.Config(
            self._lock,
            lease_duration=LEASE_DURATION_S,
            renew_deadline=RENEW_DEADLINE_S,
            retry_period=RETRY_PERIOD_S,
            onstarted_leading=self._leading.set,
            onstopped_leading=self._lost,
        )
        self._election = leaderelection.LeaderElection(config)

    def acquire(self) -> None:
        log.info(
            "waiting for the leadership Lease %s/%s (identity %s): one operator acts at a time",
            self.namespace,
            self.name,
            self.identity,
        )
        threading.Thread(target=self._election.run, name="leader-election", daemon=True).start()
        self._leading.wait()
        self._lock.led = True
        log.info("leading: holding the Lease %s/%s as %s", self.namespace, self.name, self.identity)
        if self._owner_deployment:
            self._own_lease(self._owner_deployment)

    def _own_lease(self, deployment: str) -> None:
        """Make ``deployment`` the Lease's owner, so the garbage collector deletes the Lease with it
        (the operator makes the Lease at run time: no chart owns it). Best effort: without it the
        Lease only outlives an uninstall."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            dep = client.AppsV1Api(client.ApiClient(self._configuration)).read_namespaced_deployment(
                deployment, self.namespace
            )
            uid = dep.metadata.uid if dep.metadata is not None else None
            owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment, "uid": uid}
            patch = {"metadata": {"ownerReferences": [owner]}}
            self._lock.api_instance.patch_namespaced_lease(self.name, self.namespace, patch)
            log.info("the Lease %s/%s is owned by the Deployment %s", self.namespace, self.name, deployment)
        except ApiException as exc:
            log.warning(
                "could not make the Deployment %s own the Lease %s/%s (%s): the Lease will outlive an "
                "uninstall; grant get on the Deployment and patch on leases (the chart's leader-election Role)",
                deployment,
                self.namespace,
                self.name,
                exc.reason,
            )

    def _lost(self) -> None:
        if self._lock.released:
            return
        log.error(
            "lost the leadership Lease %s/%s (not renewed within %d s): exiting so that this operator "
            "writes nothing more; the kubelet starts it again as a candidate",
            self.namespace,
            self.name,
            RENEW_DEADLINE_S,
        )
        self._on_lost()

    @staticmethod
    def _exit() -> None:
        logging.shutdown()
        os._exit(1)

    def release(self) -> None:
        """Give the Lease up (a clean stop), so the successor need not wait for it to lapse."""
        from kubernetes.client.exceptions import ApiException

        self._lock.released = True
        try:
            lease = self._lock.api_instance.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.renew_time = None
            self._lock.api_instance.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("gave up the leadership Lease %s/%s", self.namespace, self.name)
        except ApiException as exc:  # it lapses by itself; the successor only waits longer
            log.warning("could not give up the Lease %s/%s: %s", self.namespace, self.name, exc.reason)
