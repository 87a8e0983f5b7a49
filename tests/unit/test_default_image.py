"""The reward-server image of a RewardModel without ``spec.engine.image``: the operator's default
(the chart's serverImage, ``--default-server-image``), and a clear NoImage status without one."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from rewardplane.api.names import core_path, custom_path, server_selector
from rewardplane.api.spec import NO_IMAGE, InvalidSpecError
from rewardplane.api.status import DEGRADED
from rewardplane.localcluster import dev
from rewardplane.operator.__main__ import parse_args
from rewardplane.operator.conditions import compute_status
from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model
from rewardplane.operator.reconcile import Reconciler
from rewardplane.operator.render import render_children
from rewardplane.operator.status import PHASE_DEGRADED, transition_events
from rewardplane.protocol import settings
from rewardplane.testing.kube import MemoryKube
from rewardplane.testing.replicas import FakeReplicas

NOW = "2026-11-26T00:00:00Z"
DEFAULT = "localhost/rewardplane/reward-server:0.1.0-local"
CPU_NODES = (NodeInfo("cpu-a"),)


def body(**engine: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "rm", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": {
            "model": {"source": "/models/tiny"},
            "engine": {"kind": "hf", **engine},
            "gpu": {"mode": "none"},
        },
    }


def image_of(rm: dict[str, Any], default_image: str | None) -> str:
    plan = plan_reward_model(rm, ClusterView(nodes=CPU_NODES), default_image=default_image)
    [pod], _ = render_children(rm, plan)
    return str(pod["spec"]["containers"][0]["image"])


def test_an_omitted_image_is_the_operators_default_and_an_explicit_one_wins() -> None:
    assert image_of(body(), DEFAULT) == DEFAULT
    assert image_of(body(image=""), DEFAULT) == DEFAULT  # "" reaches the operator as omitted (1.20)
    assert image_of(body(image="registry.example/rs:7"), DEFAULT) == "registry.example/rs:7"
    assert image_of(body(image="registry.example/rs:7"), None) == "registry.example/rs:7"


def test_a_changed_default_rolls_the_replicas_that_use_it() -> None:
    """The image is part of the rendered Pod, hence of its spec hash: a new default (a chart
    upgrade) replaces the replicas of models without their own image, and only those."""

    def spec_hash(rm: dict[str, Any], default_image: str) -> str:
        plan = plan_reward_model(rm, ClusterView(nodes=CPU_NODES), default_image=default_image)
        [pod], _ = render_children(rm, plan)
        return str(pod["metadata"]["annotations"]["rewardplane.io/spec-hash"])

    assert spec_hash(body(), "a:1") != spec_hash(body(), "a:2")
    assert spec_hash(body(image="own:1"), "a:1") == spec_hash(body(image="own:1"), "a:2")


def test_without_any_image_planning_refuses_with_no_image_and_says_what_to_set() -> None:
    with pytest.raises(InvalidSpecError) as info:
        plan_reward_model(body(), ClusterView(nodes=CPU_NODES), default_image=None)
    assert info.value.reason == NO_IMAGE
    [message] = info.value.errors
    for named in (
        "spec.engine.image",
        "serverImage.repository",
        "--default-server-image",
        "REWARDPLANE_SERVER_IMAGE",
    ):
        assert named in message


def test_no_image_is_degraded_with_its_reason_and_a_warning_event() -> None:
    rm = body()
    with pytest.raises(InvalidSpecError) as info:
        plan_reward_model(rm, ClusterView(nodes=CPU_NODES))
    status = compute_status(rm, None, [], {}, NOW, errors=info.value.errors, error_reason=info.value.reason)
    assert (status["phase"], status["reason"]) == (PHASE_DEGRADED, NO_IMAGE)
    degraded = next(c for c in status["conditions"] if c["type"] == DEGRADED)
    assert (degraded["status"], degraded["reason"]) == ("True", NO_IMAGE)
    assert "serverImage" in degraded["message"] and "--default-server-image" in degraded["message"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "False" and "spec.engine.image" in progressing["message"]
    assert status["selector"] == server_selector("rm") and status["replicas"] == 0
    [event] = transition_events({"phase": "Pending"}, status)
    assert (event.type, event.reason) == ("Warning", NO_IMAGE)


def _reconcile(default_image: str | None, **engine: Any) -> tuple[MemoryKube, dict[str, Any]]:
    kube = MemoryKube()
    kube.put(core_path("nodes"), {"metadata": {"name": "cpu-a"}})
    kube.put(custom_path("ns"), body(**engine))
    Reconciler(kube, replicas=FakeReplicas(), default_image=default_image).reconcile(("ns", "rm"))  # type: ignore[arg-type]
    return kube, kube.get(custom_path("ns", "rm")) or {}


def test_the_reconciler_creates_no_pod_it_cannot_run_and_says_why() -> None:
    kube, rm = _reconcile(None)
    assert kube.list(core_path("pods", "ns")) == []  # never a Pod stuck in ImagePullBackOff
    assert (rm["status"]["phase"], rm["status"]["reason"]) == (PHASE_DEGRADED, NO_IMAGE)
    kube, rm = _reconcile(DEFAULT)
    [pod] = kube.list(core_path("pods", "ns"))
    assert pod["spec"]["containers"][0]["image"] == DEFAULT and rm["status"]["phase"] != PHASE_DEGRADED
    kube, _ = _reconcile(None, image="own:1")  # an explicit image needs no default
    [pod] = kube.list(core_path("pods", "ns"))
    assert pod["spec"]["containers"][0]["image"] == "own:1"


def test_the_operator_flag_defaults_to_its_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(settings.SERVER_IMAGE.name, raising=False)
    assert parse_args([]).default_server_image is None
    monkeypatch.setenv(settings.SERVER_IMAGE.name, "env/rs:1")
    assert parse_args([]).default_server_image == "env/rs:1"
    assert parse_args(["--default-server-image", "flag/rs:2"]).default_server_image == "flag/rs:2"


def test_dev_up_gives_the_operator_the_image_built_on_this_machine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ran: list[list[str]] = []

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dev, "local_image_tag", lambda: "9.9.9-local")
    monkeypatch.setattr(dev, "find_binary", lambda name: Path("/bin/helm"))
    monkeypatch.setattr(dev.subprocess, "run", run)
    dev.helm_install_operator(tmp_path / "kubeconfig")
    [cmd] = ran
    sets = {cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"}
    assert {
        "image.repository=localhost/rewardplane/operator",
        "image.tag=9.9.9-local",
        "serverImage.repository=localhost/rewardplane/reward-server",
        "serverImage.tag=9.9.9-local",
    } <= sets
    # build-images.sh names and tags the reward server so
    script = (Path(__file__).resolve().parents[2] / "scripts" / "build-images.sh").read_text()
    assert "localhost/rewardplane/$name:$TAG" in script and "build reward-server reward-server" in script
    assert dev.agent_server_image() == "localhost/rewardplane/reward-server:9.9.9-local"
