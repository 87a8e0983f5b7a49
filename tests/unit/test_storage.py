"""Model delivery (spec.model.source → volume, mount, --model) and what a reward Pod runs with."""

from __future__ import annotations

import pytest

from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model, validate_spec
from rewardplane.operator.render import NON_ROOT_UID, TOKEN_FILE, render_pod
from rewardplane.operator.storage import HF_CACHE_DIR, MODEL_MOUNT_DIR, InvalidSourceError, delivery


def test_pvc_source_mounts_the_claim_read_only() -> None:
    d = delivery("pvc://models/llama/rm-7b")
    assert d.volume == {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert d.mount["mountPath"] == MODEL_MOUNT_DIR and d.mount["readOnly"]
    assert d.model_arg == f"{MODEL_MOUNT_DIR}/llama/rm-7b"
    assert delivery("pvc://models").model_arg == MODEL_MOUNT_DIR


@pytest.mark.parametrize("source", ["file:///data/rm", "/data/rm", "/data/rm/"])
def test_node_directory_is_a_host_path(source: str) -> None:
    d = delivery(source)
    assert d.volume["hostPath"] == {"path": "/data/rm", "type": "Directory"}
    assert d.model_arg == MODEL_MOUNT_DIR and not d.is_hub


@pytest.mark.parametrize("source", ["hf://org/name", "org/name"])
def test_hub_id_downloads_into_a_cache_volume(source: str) -> None:
    d = delivery(source)
    assert d.is_hub and d.model_arg == "org/name"
    assert d.volume == {"name": "hf-cache", "emptyDir": {}} and ("HF_HOME", HF_CACHE_DIR) in d.env


@pytest.mark.parametrize(
    "source", ["s3://bucket/rm", "pvc://", "pvc://c/../../etc", "file://relative", "a/b/c"]
)
def test_bad_sources_are_refused_with_the_forms_that_work(source: str) -> None:
    with pytest.raises(InvalidSourceError):
        delivery(source)
    errors = validate_spec({"model": {"source": source}, "engine": {"kind": "hf"}, "gpu": {"mode": "none"}})
    assert len(errors) == 1 and errors[0].startswith("spec.model.source")


def _pod(source: str) -> dict:
    rm = {
        "apiVersion": "rewardplane.io/v1alpha1",
        "kind": "RewardModel",
        "metadata": {"name": "rm", "namespace": "ns", "uid": "u1"},
        "spec": {
            "model": {"source": source},
            "engine": {"kind": "hf"},
            "gpu": {"mode": "none"},
            "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}},
        },
    }
    plan = plan_reward_model(
        rm, ClusterView(nodes=(NodeInfo(name="n1", gpus=0),)), default_image="localhost/rs:test"
    )
    return render_pod(rm, plan, plan.replicas[0])


def test_reward_pod_runs_non_root_with_probes_token_file_and_the_model_volume() -> None:
    pod = _pod("pvc://models/rm")
    spec, [ctr] = pod["spec"], pod["spec"]["containers"]
    ctx = ctr["securityContext"]
    assert ctx["runAsUser"] == NON_ROOT_UID and ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"]
    assert (
        spec["securityContext"]["fsGroup"] == NON_ROOT_UID and spec["automountServiceAccountToken"] is False
    )
    for probe in ("startupProbe", "livenessProbe"):
        assert ctr[probe]["httpGet"]["path"] == "/health"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ctr["args"][ctr["args"].index("--model") + 1] == f"{MODEL_MOUNT_DIR}/rm"
    assert ctr["args"][ctr["args"].index("--token-file") + 1] == TOKEN_FILE
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec[
        "volumes"
    ]
    assert ctr["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    # the server drains on SIGTERM (--graceful-shutdown-s, default 10 s) inside the grace period
    assert spec["terminationGracePeriodSeconds"] > 10
    # ...and is never PID 1 (which would ignore a SIGTERM that lands before its handler exists)
    assert spec["shareProcessNamespace"] is True
