"""The local control plane is a real Kubernetes API: kubectl works, CRDs work, failures are clear."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from rewardplane.localcluster.binaries import BinaryNotFoundError, find_binary
from rewardplane.localcluster.controlplane import ControlPlaneError, LocalControlPlane

pytestmark = pytest.mark.cluster


def _kubectl(control_plane: Any, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        kubectl = str(find_binary("kubectl"))
    except BinaryNotFoundError as exc:
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    return subprocess.run(
        [kubectl, "--kubeconfig", str(control_plane.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_kubectl_talks_to_the_control_plane(control_plane: Any) -> None:
    version = _kubectl(control_plane, "version", "-o", "json")
    assert version.returncode == 0, version.stderr
    assert '"serverVersion"' in version.stdout
    namespaces = _kubectl(control_plane, "get", "ns", "-o", "name")
    assert namespaces.returncode == 0, namespaces.stderr
    assert "namespace/default" in namespaces.stdout.split()


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.rewardplane.io"},
    "spec": {
        "group": "test.rewardplane.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"size": {"type": "integer", "minimum": 1}},
                            },
                            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                        },
                    }
                },
            }
        ],
    },
}


def test_custom_resources_work(kube_api: Any) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    ext = client.ApiextensionsV1Api(kube_api)
    ext.create_custom_resource_definition(CRD, _request_timeout=10)
    deadline = time.monotonic() + 30
    while True:
        crd = ext.read_custom_resource_definition(CRD["metadata"]["name"], _request_timeout=10)
        if any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or [])):
            break
        assert time.monotonic() < deadline, "CRD not Established within 30 s"
        time.sleep(0.2)

    objs = client.CustomObjectsApi(kube_api)
    args = ("test.rewardplane.io", "v1", "default", "widgets")

    def create(name: str, size: int) -> None:
        body = {"apiVersion": "test.rewardplane.io/v1", "kind": "Widget", "metadata": {"name": name}}
        objs.create_namespaced_custom_object(*args, {**body, "spec": {"size": size}}, _request_timeout=10)

    # The served API may lag Established by a moment: retry the first create briefly.
    for attempt in range(50):
        try:
            create("w1", 3)
            break
        except ApiException as exc:
            if exc.status != 404 or attempt == 49:
                raise
            time.sleep(0.2)
    got = objs.get_namespaced_custom_object(*args, "w1", _request_timeout=10)
    assert got["spec"]["size"] == 3
    # schema validation is enforced
    with pytest.raises(ApiException) as bad:
        create("w2", 0)
    assert bad.value.status == 422
    # the status subresource takes patches
    objs.patch_namespaced_custom_object_status(
        *args,
        "w1",
        {"status": {"phase": "Ready"}},
        _content_type="application/merge-patch+json",
        _request_timeout=10,
    )
    assert objs.get_namespaced_custom_object(*args, "w1", _request_timeout=10)["status"]["phase"] == "Ready"


def test_failed_start_reports_the_log_and_leaves_nothing_running(control_plane: Any, tmp_path: Path) -> None:
    if not isinstance(control_plane, LocalControlPlane):
        pytest.skip("needs the embedded control plane")
    # The API server cannot bind a port the running control plane already holds.
    broken = LocalControlPlane(tmp_path / "cp2", apiserver_port=control_plane.apiserver_port)
    with pytest.raises(ControlPlaneError) as err:
        broken.start(timeout_s=30)
    message = str(err.value)
    assert "kube-apiserver" in message and "Last lines of" in message
    assert not broken.running
    # etcd was stopped after the failed start: no process refers to the second workdir any more
    leftovers = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(tmp_path / "cp2") in cmdline:
            leftovers.append(cmdline.replace("\0", " "))
    assert not leftovers
