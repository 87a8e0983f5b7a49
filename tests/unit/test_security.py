"""What a RewardModel's servers let in, and with which privileges they run."""

from __future__ import annotations

from typing import Any

from rewardplane.api.names import LABEL_MODEL, LABEL_TRAINER_OF
from rewardplane.operator.planning import ClusterView, plan_reward_model
from rewardplane.operator.render import render_network_policy, render_pod

from .test_planning import CPU_NODES, _container, cpu_rm


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def allowed(policy: dict[str, Any], peer_labels: dict[str, str], port: int) -> bool:
    """Whether a Pod with ``peer_labels`` may open ``port`` on a selected server (the policy's
    ingress rules as the NetworkPolicy API defines them: a rule without ``from`` admits every
    source, without ``ports`` every port; rules add up)."""
    for rule in policy["spec"]["ingress"]:
        sources = rule.get("from")
        ports = rule.get("ports")
        source_ok = sources is None or any(_selects(s["podSelector"], peer_labels) for s in sources)
        port_ok = ports is None or any(p["port"] == port for p in ports)
        if source_ok and port_ok:
            return True
    return False


def test_network_policy_opens_http_to_clients_and_the_rest_to_trainers_and_peers() -> None:
    body = cpu_rm(replicas=2)
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    policy = render_network_policy(body, plan)
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    server = render_pod(body, plan, plan.replicas[0])["metadata"]["labels"]
    assert _selects(policy["spec"]["podSelector"], server)
    http, group = plan.ports.http, plan.replicas[1].group_port
    ephemeral = 41000  # gloo and NCCL connect ranks over ephemeral ports
    client = {"app": "some-client"}
    trainer = {LABEL_TRAINER_OF: "rm"}
    other_trainer = {LABEL_TRAINER_OF: "another-model"}
    for port in (http,):
        assert allowed(policy, client, port) and allowed(policy, trainer, port)
    for port in (group, ephemeral):
        assert not allowed(policy, client, port), port
        assert not allowed(policy, other_trainer, port), port
        assert not allowed(
            policy, {LABEL_MODEL: "another-model", "app.kubernetes.io/component": "reward-server"}, port
        )
        assert allowed(policy, trainer, port), port
        assert allowed(policy, server, port), port  # a peer restore between the model's replicas
    assert policy["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]


def test_server_container_runs_without_privileges_on_a_read_only_root() -> None:
    body = cpu_rm()
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    pod = render_pod(body, plan, plan.replicas[0])
    ctx = _container(pod)["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["runAsNonRoot"] and ctx["runAsUser"] != 0
    env = {e["name"]: e.get("value") for e in _container(pod)["env"]}
    scratch = next(m for m in _container(pod)["volumeMounts"] if m["name"] == "scratch")
    assert env["TMPDIR"] == env["HOME"] == scratch["mountPath"]
    assert {"name": "scratch", "emptyDir": {}} in pod["spec"]["volumes"]


def test_with_persist_dir_the_server_keeps_root_to_write_the_hostpath() -> None:
    body = cpu_rm(weightSync={"persistDir": "/var/lib/rm"})
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    ctx = _container(render_pod(body, plan, plan.replicas[0]))["securityContext"]
    # explicitly root: the image's own user (65532) could not write the root-owned hostPath
    assert ctx["readOnlyRootFilesystem"] and "runAsNonRoot" not in ctx and ctx["runAsUser"] == 0
    # root without capabilities cannot write a directory another user owns (found by the main job:
    # a persistDir left by an earlier release's uid 65532); only DAC_OVERRIDE comes back
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    assert not ctx["allowPrivilegeEscalation"]


def test_reconciler_keeps_the_policy_as_rendered_and_removes_it_when_disabled() -> None:
    from rewardplane.api.names import custom_path
    from rewardplane.operator.cluster import network_policy_path
    from rewardplane.operator.reconcile import Reconciler
    from rewardplane.testing.kube import MemoryKube
    from rewardplane.testing.replicas import FakeReplicas

    kube = MemoryKube()
    kube.put("/api/v1/nodes", {"metadata": {"name": "cpu-a"}})
    body = cpu_rm()
    kube.put(custom_path("default"), body)
    reconciler = Reconciler(kube, replicas=FakeReplicas())  # type: ignore[arg-type]
    reconciler.reconcile(("default", "rm"))
    path = network_policy_path("default", "rm-servers")
    policy = kube.get(path)
    assert policy is not None and policy["spec"]["podSelector"]["matchLabels"][LABEL_MODEL] == "rm"
    kube.merge_patch(path, {"spec": {"ingress": [{}]}})  # someone opened it up by hand
    reconciler.reconcile(("default", "rm"))
    assert (kube.get(path) or {})["spec"] == policy["spec"]  # put back as rendered
    kube.merge_patch(custom_path("default", "rm"), {"spec": {"networkPolicy": {"enabled": False}}})
    reconciler.reconcile(("default", "rm"))
    assert kube.get(path) is None
