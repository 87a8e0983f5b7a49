"""Fixtures of the real-node end-to-end suite (``-m e2e``).

``real_cluster`` (module scope) brings up the real single-node cluster
(:class:`rewardplane.localcluster.realnode.RealNode`: kubelet, containerd, CNI, kube-proxy, the
control plane) in its own state dir under the cache, imports the images that
``scripts/build-images.sh`` built, and installs the operator with the Helm chart. The suite's
last test brings it down and checks that nothing is left; the fixture brings it down anyway.

REWARDPLANE_E2E_KEEP=1 leaves the cluster up after a failure, to look at it.

Needs root, the binaries of ``scripts/install-k8s-tools.sh`` and the images. Where any is
missing the suite is skipped, except under CI, where that fails the run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rewardplane.localcluster import realnode
from rewardplane.localcluster.binaries import cache_dir, missing_binaries
from rewardplane.localcluster.controlplane import api_client_for
from rewardplane.localcluster.dev import OPERATOR_NAMESPACE, OPERATOR_RELEASE, helm_install_operator
from rewardplane.localcluster.realnode.tools import KUBE_BINARIES
from rewardplane.protocol import settings
from tests.fixtures.operator import wait_for as poll

NODE_BINARIES = (*KUBE_BINARIES, "kubectl", "helm")
IMAGES = ("pause", "operator", "reward-server", "trainer")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the real node needs root (containerd, CNI, iptables)"
    missing = missing_binaries(NODE_BINARIES)
    if missing:
        return f"missing {', '.join(missing)}: run scripts/install-k8s-tools.sh"
    absent = [i for i in IMAGES if not (realnode.images_dir() / f"{i}.tar").exists()]
    if absent:
        return f"images not built ({', '.join(absent)}): run bash scripts/build-images.sh"
    return None


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """Poll ``check`` until it returns something truthy; fail the test with ``what`` on timeout."""
    return poll(what, check, timeout_s, interval_s=interval_s)


@dataclass
class RealCluster:
    node: realnode.RealNode
    kubeconfig: Path
    api: Any  # kubernetes.client.ApiClient
    volumes: Path  # host directories the suite serves as volumes (model, persisted weights)
    model_cache: Path  # the node's cache of downloaded models (the chart's modelCache.hostPath)

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> Any:
        from kubernetes import client

        return client.AppsV1Api(self.api)

    @property
    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api)


@pytest.fixture(scope="module")
def real_cluster() -> Iterator[RealCluster]:
    why = _unavailable()
    if why:
        if _in_ci():
            pytest.fail(f"CI is set and the real-node suite cannot run: {why}")
        pytest.skip(why)
    state = cache_dir() / "realnode-e2e"
    node = realnode.RealNode(state)
    if node.running():  # left up by a run with REWARDPLANE_E2E_KEEP: start from scratch
        node.down()
    kubeconfig = node.up(timeout_s=300)
    api = api_client_for(kubeconfig)
    try:
        # the node's model cache in the suite's own state: every run starts it empty
        model_cache = state / "model-cache"
        shutil.rmtree(model_cache, ignore_errors=True)
        helm_install_operator(
            kubeconfig,
            values={"modelCache.hostPath": str(model_cache)},
            log_path=node.layout.logs / "helm.log",
        )
        volumes = state / "volumes"
        shutil.rmtree(volumes, ignore_errors=True)  # model and weights left from another run must not leak in
        volumes.mkdir()
        yield RealCluster(node=node, kubeconfig=kubeconfig, api=api, volumes=volumes, model_cache=model_cache)
    finally:
        api.close()
        # The suite's last test normally brought it down (and checked it); REWARDPLANE_E2E_KEEP=1
        # keeps a failed run's cluster for a look (KUBECONFIG=<state>/kubeconfig).
        if node.running() and not settings.E2E_KEEP.get():
            node.down()


__all__ = ["OPERATOR_NAMESPACE", "OPERATOR_RELEASE", "RealCluster", "wait_for"]
