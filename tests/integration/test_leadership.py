"""One operator at a time, on a real kube-apiserver: a second operator waits for the leadership
Lease while the first holds it, acts on nothing meanwhile, and takes over as soon as the first
stops cleanly (it gives the Lease up instead of letting it lapse)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rewardplane.api.kube import Kube
from rewardplane.operator.leadership import LEASE_DURATION_S, LEASE_NAME
from tests.fixtures.operator import start_operator, stop_operator, wait_for

pytestmark = [pytest.mark.cluster]


def lease_holder(kube: Kube, ns: str) -> str | None:
    lease = kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{LEASE_NAME}")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def test_a_second_operator_waits_for_the_lease_and_takes_over_on_a_clean_stop(
    kube: Kube, control_plane: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    ns, args = k8s_namespace, ["--leader-election-namespace", k8s_namespace]
    first = start_operator(control_plane.kubeconfig, tmp_path / "first.log", args)
    second = None
    try:
        holder = wait_for("the first operator to lead", lambda: lease_holder(kube, ns), 30, first.logs)
        assert f"_{first.proc.pid}_" in holder
        second = start_operator(control_plane.kubeconfig, tmp_path / "second.log", args)
        time.sleep(5)  # more than two retry periods: it would have taken the Lease by now if it could
        assert lease_holder(kube, ns) == holder
        assert "waiting for the leadership Lease" in second.log_path.read_text()
        assert "leading:" not in second.log_path.read_text()

        stopped = time.monotonic()
        stop_operator(first)
        taken = wait_for(
            "the second operator to lead",
            lambda: (h := lease_holder(kube, ns)) and f"_{second.proc.pid}_" in h,
            LEASE_DURATION_S,
            second.logs,
        )
        assert taken
        took = time.monotonic() - stopped
        assert "gave up the leadership Lease" in first.log_path.read_text()
        print(f"takeover {took:.1f} s after the first operator's stop")
    finally:
        if first.proc.poll() is None:
            stop_operator(first)
        if second is not None:
            stop_operator(second)
