"""Pure planning, rendering and status: no cluster, no sockets."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import pytest

from rewardplane.api.spec import InvalidSpecError, parse_spec
from rewardplane.api.status import PHASE_DEGRADED, PHASE_FAILED, PHASE_PENDING, PHASE_PROGRESSING, PHASE_READY
from rewardplane.operator.conditions import compute_status
from rewardplane.operator.planning import (
    GPU_RESOURCE,
    OPERATOR_FLAGS,
    RESERVATIONS_ANNOTATION,
    ClusterView,
    NodeInfo,
    Reservation,
    gpus_in_use,
    model_ports,
    node_info,
    parse_reservations,
    plan_reward_model,
    rank_offset,
    validate_spec,
)
from rewardplane.operator.render import (
    ANNOTATION_SPEC_HASH,
    LABEL_COMPONENT,
    LABEL_MODEL,
    LABEL_REPLICA,
    TOKEN_FILE,
    needs_replacement,
    new_token,
    render_children,
    render_pod,
    render_service,
    render_token_secret,
    server_args,
    weights_dir,
)
from rewardplane.operator.rollout import pod_actions
from rewardplane.operator.status import ProbeResult, transition_events
from rewardplane.protocol import derive_ports

NOW = "2026-11-26T00:00:00Z"
IMAGE = "localhost/rewardplane/reward-server:test"


def rm(name: str = "rm", created: str = "2026-11-26T00:00:00Z", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"source": "/models/tiny"}}
    body.update(spec)
    body["engine"] = {"image": IMAGE, **(body.get("engine") or {})}  # an explicit image, unless given
    return {
        "apiVersion": "rewardplane.io/v1alpha1",
        "kind": "RewardModel",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": f"uid-{name}",
            "generation": 1,
            "creationTimestamp": created,
        },
        "spec": body,
    }


def cpu_rm(name: str = "rm", **spec: Any) -> dict[str, Any]:
    return rm(name, **{"engine": {"kind": "hf"}, "gpu": {"mode": "none"}, **spec})


def shared_rm(
    name: str, fraction: float, devices: list[int], created: str = "2026-11-26T00:00:00Z", **spec: Any
):
    return rm(
        name,
        created,
        gpu={"mode": "shared", "node": "gpu-1", "deviceIds": devices, "memoryFraction": fraction},
        **spec,
    )


NODES = (NodeInfo("gpu-1", gpus=4), NodeInfo("gpu-2", gpus=2))
CPU_NODES = (NodeInfo("cpu-a"), NodeInfo("cpu-b"))


def errors_of(body: dict[str, Any], cluster: ClusterView) -> list[str]:
    with pytest.raises(InvalidSpecError) as info:
        plan_reward_model(body, cluster)
    return info.value.errors


# ---------------------------------------------------------------- spec parsing and validation


def test_defaults_match_the_crd() -> None:
    spec = parse_spec({"model": {"source": "x"}})
    assert spec.replicas == 1 and spec.tensor_parallel_size == 1
    assert spec.gpu.mode.value == "exclusive" and spec.gpu.memory_fraction == 0.9
    assert spec.engine.kind.value == "vllm" and spec.model.pooling == "last" and spec.model.num_labels == 1
    assert spec.weight_sync.enabled and spec.weight_sync.default_training_mode == "full"


def test_valid_specs_have_no_errors() -> None:
    assert validate_spec(cpu_rm()["spec"], "rm") == []
    assert validate_spec(shared_rm("a", 0.3, [0])["spec"], "a") == []


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_memory_fraction_out_of_range_is_refused(fraction: float) -> None:
    errors = validate_spec(rm(gpu={"memoryFraction": fraction})["spec"])
    assert len(errors) == 1 and "spec.gpu.memoryFraction" in errors[0]


def test_memory_fraction_one_is_allowed() -> None:
    assert validate_spec(rm(gpu={"memoryFraction": 1.0})["spec"]) == []


def test_negative_replicas_and_missing_source_reported_together() -> None:
    errors = validate_spec({"model": {}, "replicas": -1})
    joined = " ".join(errors)
    assert "spec.model.source" in joined and "spec.replicas" in joined


def test_unknown_enum_values_are_refused() -> None:
    errors = validate_spec(rm(model={"source": "x", "pooling": "max"}, engine={"kind": "tgi"})["spec"])
    assert any("spec.model.pooling" in e for e in errors) and any("spec.engine.kind" in e for e in errors)


def test_vllm_on_cpu_is_refused_with_the_fix() -> None:
    errors = validate_spec(rm(gpu={"mode": "none"})["spec"])
    assert any("engine.kind: hf" in e for e in errors)


def test_tensor_parallel_on_cpu_is_refused() -> None:
    errors = validate_spec(cpu_rm(tensorParallelSize=2)["spec"])
    assert any("tensorParallelSize 2" in e for e in errors)


def test_shared_needs_node_and_enough_devices() -> None:
    errors = validate_spec(
        rm(replicas=2, tensorParallelSize=2, gpu={"mode": "shared", "deviceIds": [0, 1]})["spec"]
    )
    assert any("spec.gpu.node is required" in e for e in errors)
    assert any("= 4 are needed" in e for e in errors)


def test_shared_duplicate_devices_refused() -> None:
    errors = validate_spec(rm(gpu={"mode": "shared", "node": "n", "deviceIds": [1, 1]})["spec"])
    assert any("twice" in e for e in errors)


def test_device_ids_outside_shared_mode_refused() -> None:
    errors = validate_spec(rm(gpu={"mode": "exclusive", "deviceIds": [0]})["spec"])
    assert any("only applies to gpu.mode shared" in e for e in errors)


@pytest.mark.parametrize("arg", ["--port", "--port=9000", "--gpu-memory-utilization=0.5"])
def test_extra_args_must_not_override_operator_flags(arg: str) -> None:
    errors = validate_spec(cpu_rm(engine={"kind": "hf", "extraArgs": [arg, "1"]})["spec"])
    assert len(errors) == 1 and "remove it from extraArgs" in errors[0]


def test_render_sets_every_operator_flag_it_guards() -> None:
    body = rm(
        model={"source": "x", "maxLength": 8, "aliases": ["y"]},
        tensorParallelSize=2,
        weightSync={"persistDir": "/w"},
        lora={"enabled": True, "maxRank": 32},
    )
    plan = plan_reward_model(body, ClusterView(nodes=NODES))
    args = server_args(plan, plan.replicas[0])
    assert {a for a in args if a.startswith("--")} == set(OPERATOR_FLAGS)
    assert args[args.index("--max-lora-rank") + 1] == "32"


def test_lora_rank_vllm_cannot_serve_is_refused() -> None:
    errors = validate_spec(rm(engine={"kind": "vllm"}, lora={"enabled": True, "maxRank": 24})["spec"])
    assert any("spec.lora.maxRank 24 is not a rank vLLM serves" in e for e in errors)
    assert validate_spec(rm(engine={"kind": "vllm"}, lora={"enabled": True, "maxRank": 32})["spec"]) == []


def test_a_generative_model_gets_task_generate_and_no_head_flags() -> None:
    plan = plan_reward_model(rm(model={"source": "x", "task": "generate"}), ClusterView(nodes=NODES))
    args = server_args(plan, plan.replicas[0])
    assert args[args.index("--task") + 1] == "generate"
    assert "--pooling" not in args and "--num-labels" not in args
    # its saved weights never restore onto the same source served as a scorer
    score_plan = plan_reward_model(rm(model={"source": "x"}), ClusterView(nodes=NODES))
    assert weights_dir("/w", "uid", plan, plan.replicas[0]) != weights_dir(
        "/w", "uid", score_plan, score_plan.replicas[0]
    )


def test_a_process_reward_model_gets_its_step_flags_and_no_pooling() -> None:
    model = {
        "source": "x",
        "kind": "process",
        "process": {"stepTag": "<extra_0>", "aggregation": "min", "vllmPooling": "token"},
    }
    plan = plan_reward_model(rm(model=model, engine={"kind": "vllm"}), ClusterView(nodes=NODES))
    args = server_args(plan, plan.replicas[0])
    flags = dict(zip(args, args[1:], strict=False))
    assert (flags["--model-kind"], flags["--step-tag"], flags["--step-aggregation"]) == (
        "process",
        "<extra_0>",
        "min",
    )
    assert (flags["--step-separator"], flags["--good-label"], flags["--prm-pooling"]) == (
        "\n\n",
        "1",
        "token",
    )
    assert "--pooling" not in args and "--num-labels" not in args
    hf = plan_reward_model(
        rm(model=model, engine={"kind": "hf"}, gpu={"mode": "none"}), ClusterView(nodes=NODES)
    )
    assert "--prm-pooling" not in server_args(hf, hf.replicas[0])  # a vLLM flag only
    no_agg = plan_reward_model(rm(model={**model, "process": {"stepTag": "<s1>"}}), ClusterView(nodes=NODES))
    assert "--step-aggregation" not in server_args(no_agg, no_agg.replicas[0])
    # its saved weights never restore onto the same source served as a sequence model
    seq = plan_reward_model(rm(model={"source": "x"}, engine={"kind": "vllm"}), ClusterView(nodes=NODES))
    assert weights_dir("/w", "uid", plan, plan.replicas[0]) != weights_dir("/w", "uid", seq, seq.replicas[0])


def test_a_process_reward_model_without_its_tag_is_refused_by_name() -> None:
    errors = validate_spec({"model": {"source": "x", "kind": "process", "pooling": "mean"}})
    assert len(errors) == 2
    assert "spec.model.process.stepTag" in errors[0] and "<extra_0>" in errors[0]
    assert "spec.model.pooling" in errors[1]
    assert validate_spec({"model": {"source": "x", "kind": "process", "process": {"stepTag": "<t>"}}}) == []
    bad = validate_spec({"model": {"source": "x", "kind": "process", "process": {"aggregation": "median"}}})
    assert any("spec.model.process.aggregation" in e for e in bad)


def test_head_fields_on_a_generative_model_are_refused_by_name() -> None:
    errors = validate_spec({"model": {"source": "x", "task": "generate", "numLabels": 3, "pooling": "mean"}})
    assert len(errors) == 2
    assert "spec.model.numLabels" in errors[0] and "task: generate" in errors[0]
    assert "spec.model.pooling" in errors[1]
    assert validate_spec({"model": {"source": "x", "task": "generate"}}) == []
    assert any("spec.model.task" in e for e in validate_spec({"model": {"source": "x", "task": "judge"}}))


@pytest.mark.parametrize("name", ["1rm", "RM", "rm_a", "a" * 70])
def test_bad_names_refused(name: str) -> None:
    assert validate_spec(cpu_rm()["spec"], name)


# ---------------------------------------------------------------- ports


def test_ports_follow_the_offset_convention() -> None:
    ports = model_ports(parse_spec({"model": {"source": "x"}}))
    assert ports == derive_ports() and (ports.http, ports.group) == (8001, 51217)


def test_ports_offset_from_custom_policy_ports() -> None:
    spec = parse_spec(
        {"model": {"source": "x"}, "ports": {"policyHttpPort": 9000, "policyGroupPort": 40000, "offset": 2}}
    )
    ports = model_ports(spec)
    assert (ports.http, ports.group) == (9002, 40002)


def test_explicit_ports_win() -> None:
    spec = parse_spec({"model": {"source": "x"}, "ports": {"http": 7000, "group": 45000, "offset": 5}})
    assert (model_ports(spec).http, model_ports(spec).group) == (7000, 45000)


@pytest.mark.parametrize(
    "ports",
    [{"http": 0}, {"group": 70000}, {"policyHttpPort": 65535}, {"offset": -9000}],
)
def test_bad_ports_refused(ports: dict[str, int]) -> None:
    errors = validate_spec(cpu_rm(ports=ports)["spec"])
    assert errors and all("spec.ports" in e for e in errors)


def test_group_ports_of_last_replica_must_fit() -> None:
    errors = validate_spec(cpu_rm(replicas=3, ports={"group": 65534})["spec"])
    assert any("replica 2 would use group port 65536" in e for e in errors)


def test_http_port_inside_group_range_refused() -> None:
    errors = validate_spec(cpu_rm(replicas=3, ports={"http": 51218})["spec"])
    assert any("collides" in e for e in errors)


def test_per_replica_group_ports_and_rank_offsets() -> None:
    body = rm(replicas=3, tensorParallelSize=2)
    plan = plan_reward_model(body, ClusterView(nodes=(NodeInfo("big", gpus=8),)))
    assert [r.group_port for r in plan.replicas] == [51217, 51218, 51219]
    assert [r.rank_offset for r in plan.replicas] == [0, 2, 4]
    assert rank_offset(3, 4) == 12


# ---------------------------------------------------------------- placement


def test_exclusive_requests_whole_gpus_and_spreads() -> None:
    plan = plan_reward_model(rm(replicas=2, tensorParallelSize=2), ClusterView(nodes=NODES))
    assert [(r.node, r.gpus, r.device_ids) for r in plan.replicas] == [("gpu-1", 2, ()), ("gpu-1", 2, ())]
    plan = plan_reward_model(rm(replicas=3, tensorParallelSize=2), ClusterView(nodes=NODES))
    assert sorted(r.node for r in plan.replicas) == ["gpu-1", "gpu-1", "gpu-2"]


def test_exclusive_counts_gpus_held_by_other_pods() -> None:
    cluster = ClusterView(nodes=NODES, gpus_in_use={"gpu-1": 4})
    plan = plan_reward_model(rm(replicas=1, tensorParallelSize=2), cluster)
    assert plan.replicas[0].node == "gpu-2"


def test_exclusive_without_room_names_free_gpus() -> None:
    errors = errors_of(rm(replicas=4, tensorParallelSize=2), ClusterView(nodes=NODES))
    assert any("replica 3 needs 2 free nvidia.com/gpu" in e and "gpu-1=0" in e for e in errors)


def test_exclusive_pinned_node_must_have_room() -> None:
    errors = errors_of(rm(tensorParallelSize=4, gpu={"node": "gpu-2"}), ClusterView(nodes=NODES))
    assert any("on node gpu-2, which has 2" in e for e in errors)


def test_exclusive_avoids_devices_pinned_by_shared_models() -> None:
    peer = shared_rm("colocated", 0.3, [0, 1, 2], replicas=3)
    plan = plan_reward_model(
        rm("new", "2026-11-27T00:00:00Z", tensorParallelSize=2), ClusterView(nodes=NODES, peers=(peer,))
    )
    assert plan.replicas[0].node == "gpu-2"


def test_existing_replicas_stay_on_their_node() -> None:
    cluster = ClusterView(nodes=CPU_NODES, current_nodes={0: "cpu-b"})
    plan = plan_reward_model(cpu_rm(replicas=2), cluster)
    assert [r.node for r in plan.replicas] == ["cpu-b", "cpu-a"]


def test_cpu_replicas_spread_over_ready_nodes() -> None:
    nodes = (*CPU_NODES, NodeInfo("cpu-c", ready=False))
    plan = plan_reward_model(cpu_rm(replicas=4), ClusterView(nodes=nodes))
    assert [r.node for r in plan.replicas] == ["cpu-a", "cpu-b", "cpu-a", "cpu-b"]
    assert all(r.gpus == 0 and r.device_ids == () for r in plan.replicas)


def test_no_nodes_is_an_actionable_error() -> None:
    errors = errors_of(cpu_rm(), ClusterView())
    assert any("start a node agent" in e for e in errors)


def test_no_ready_node_for_cpu_replicas() -> None:
    errors = errors_of(cpu_rm(), ClusterView(nodes=(NodeInfo("cpu-a", ready=False),)))
    assert any("no ready node" in e for e in errors)


def test_unknown_pinned_node_lists_nodes() -> None:
    errors = errors_of(cpu_rm(gpu={"mode": "none", "node": "nope"}), ClusterView(nodes=CPU_NODES))
    assert any("'nope' is not a registered Node (nodes: cpu-a, cpu-b)" in e for e in errors)


def test_shared_pins_node_and_device_slices() -> None:
    plan = plan_reward_model(
        shared_rm("a", 0.3, [0, 1, 2, 3], replicas=2, tensorParallelSize=2), ClusterView(nodes=NODES)
    )
    assert [(r.node, r.device_ids, r.gpus) for r in plan.replicas] == [
        ("gpu-1", (0, 1), 0),
        ("gpu-1", (2, 3), 0),
    ]


def test_shared_device_must_exist_on_node() -> None:
    errors = errors_of(shared_rm("a", 0.3, [5]), ClusterView(nodes=NODES))
    assert any("[5] do not exist on node gpu-1" in e for e in errors)


def test_shared_fractions_that_fit() -> None:
    peer = shared_rm("a", 0.7, [0], "2026-11-25T00:00:00Z")
    plan = plan_reward_model(shared_rm("b", 0.3, [0]), ClusterView(nodes=NODES, peers=(peer,)))
    assert plan.replicas[0].device_ids == (0,)


def test_shared_overcommit_names_other_models_and_the_fix() -> None:
    peer = shared_rm("a", 0.6, [0], "2026-11-25T00:00:00Z")
    cluster = ClusterView(nodes=NODES, peers=(peer,), reservations=(Reservation("gpu-1", 0, 0.2, "policy"),))
    errors = errors_of(shared_rm("b", 0.5, [0]), cluster)
    assert len(errors) == 1
    message = errors[0]
    assert "RewardModel default/a 0.6" in message and "reservation policy 0.2" in message
    assert "at most 0.20" in message and "spec.gpu.memoryFraction" in message


def test_overcommit_refuses_the_newer_model_only() -> None:
    older = shared_rm("a", 0.6, [0], "2026-11-25T00:00:00Z")
    newer = shared_rm("b", 0.6, [0], "2026-11-26T00:00:00Z")
    plan_reward_model(older, ClusterView(nodes=NODES, peers=(newer,)))  # the running one keeps running
    with pytest.raises(InvalidSpecError) as info:
        plan_reward_model(newer, ClusterView(nodes=NODES, peers=(older,)))
    assert info.value.reason == "PlacementRefused"


def test_overcommit_against_node_declared_reservation() -> None:
    node = node_info(
        {
            "metadata": {
                "name": "gpu-1",
                "annotations": {
                    RESERVATIONS_ANNOTATION: '[{"device": 0, "fraction": 0.8, "owner": "vllm-policy"}]'
                },
            },
            "status": {"capacity": {GPU_RESOURCE: "4"}},
        }
    )
    errors = errors_of(shared_rm("a", 0.3, [0]), ClusterView(nodes=(node,)))
    assert any("reservation vllm-policy 0.8" in e for e in errors)


def test_full_device_says_pick_another() -> None:
    cluster = ClusterView(nodes=NODES, reservations=(Reservation("gpu-1", 0, 1.0, "policy"),))
    assert any("pick another device" in e for e in errors_of(shared_rm("a", 0.1, [0]), cluster))


def test_deleted_and_invalid_peers_do_not_count() -> None:
    gone = shared_rm("gone", 0.9, [0], "2026-11-25T00:00:00Z")
    gone["metadata"]["deletionTimestamp"] = NOW
    broken = shared_rm("broken", 0.9, [0], "2026-11-25T00:00:00Z", replicas=-1)
    plan_reward_model(shared_rm("b", 0.5, [0]), ClusterView(nodes=NODES, peers=(gone, broken)))


def test_bad_reservation_annotation_is_reported() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        parse_reservations("n", "{oops")
    with pytest.raises(ValueError, match="fraction"):
        parse_reservations("n", '[{"device": 0, "fraction": 2}]')
    node = node_info(
        {
            "metadata": {"name": "gpu-1", "annotations": {RESERVATIONS_ANNOTATION: "[1]"}},
            "status": {"capacity": {GPU_RESOURCE: 1}},
        }
    )
    assert node.reservation_error
    assert any("bad entry" in e for e in errors_of(shared_rm("a", 0.3, [0]), ClusterView(nodes=(node,))))


def test_node_info_reads_gpus_and_readiness() -> None:
    node = node_info(
        {
            "metadata": {"name": "n"},
            "status": {
                "allocatable": {GPU_RESOURCE: "2"},
                "conditions": [{"type": "Ready", "status": "False"}],
            },
        }
    )
    assert (node.gpus, node.ready) == (2, False)


def test_gpus_in_use_excludes_own_and_finished_pods() -> None:
    def pod(model: str, node: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
        return {
            "metadata": {"namespace": "default", "labels": {LABEL_MODEL: model}},
            "spec": {"nodeName": node, "containers": [{"resources": {"limits": {GPU_RESOURCE: gpus}}}]},
            "status": {"phase": phase},
        }

    pods = [pod("a", "n1", 2), pod("b", "n1", 1), pod("b", "n2", 4, "Failed")]
    assert gpus_in_use(pods, exclude_model=("default", "a")) == {"n1": 1}


# ---------------------------------------------------------------- rendering


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(pod)["env"]}


def _arg(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_cpu_pod_runs_the_hf_engine_on_cpu() -> None:
    body = cpu_rm(model={"source": "/models/tiny", "servedName": "judge", "maxLength": 512, "numLabels": 3})
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    pod = render_pod(body, plan, plan.replicas[0])
    args = _container(pod)["args"]
    assert _arg(args, "--engine") == "hf" and _arg(args, "--device") == "cpu"
    assert _arg(args, "--host") == "$(POD_IP)" and _arg(args, "--port") == "8001"
    assert _arg(args, "--served-model-name") == "judge" and _arg(args, "--max-model-len") == "512"
    assert _arg(args, "--num-labels") == "3" and _arg(args, "--token-file") == TOKEN_FILE
    assert "--gpu-memory-utilization" not in args and "--tensor-parallel-size" not in args
    assert _env(pod)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "resources" not in _container(pod)


def test_pod_identity_labels_owner_and_placement() -> None:
    body = cpu_rm(replicas=2)
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    pod = render_pod(body, plan, plan.replicas[1])
    meta = pod["metadata"]
    assert (
        meta["name"] == "rm-1"
        and meta["labels"][LABEL_MODEL] == "rm"
        and meta["labels"][LABEL_REPLICA] == "1"
    )
    assert meta["ownerReferences"] == [
        {
            "apiVersion": "rewardplane.io/v1alpha1",
            "kind": "RewardModel",
            "name": "rm",
            "uid": "uid-rm",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pod["spec"]["nodeName"] == "cpu-b"
    probe = _container(pod)["readinessProbe"]["httpGet"]
    assert probe == {"path": "/ready", "port": 8001}  # 200 only once the operator admitted it
    assert "--require-admission" in _container(pod)["args"]
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "rm-control-token"
    assert {p["name"]: p["containerPort"] for p in _container(pod)["ports"]} == {
        "http": 8001,
        "nccl-group": 51218,
    }


def test_exclusive_pod_requests_gpus_for_vllm() -> None:
    body = rm(tensorParallelSize=2, gpu={"memoryFraction": 0.85}, resources={"limits": {"memory": "32Gi"}})
    plan = plan_reward_model(body, ClusterView(nodes=NODES))
    pod = render_pod(body, plan, plan.replicas[0])
    args = _container(pod)["args"]
    assert _arg(args, "--engine") == "vllm" and _arg(args, "--device") == "cuda"
    assert _arg(args, "--gpu-memory-utilization") == "0.85" and _arg(args, "--tensor-parallel-size") == "2"
    assert _container(pod)["resources"]["limits"] == {"memory": "32Gi", GPU_RESOURCE: 2}
    assert "CUDA_VISIBLE_DEVICES" not in _env(pod)


def test_shared_pod_pins_devices_without_requesting_gpus() -> None:
    body = shared_rm("a", 0.3, [2, 3], tensorParallelSize=2)
    plan = plan_reward_model(body, ClusterView(nodes=NODES))
    pod = render_pod(body, plan, plan.replicas[0])
    assert _env(pod)["CUDA_VISIBLE_DEVICES"] == "2,3" and _env(pod)["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert "resources" not in _container(pod)
    assert (
        pod["spec"]["nodeName"] == "gpu-1"
        and _arg(_container(pod)["args"], "--gpu-memory-utilization") == "0.3"
    )


def test_extra_args_and_persist_dir() -> None:
    body = cpu_rm(
        engine={"kind": "hf", "extraArgs": ["--foo", "1"]}, weightSync={"persistDir": "/var/lib/rm"}
    )
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    args = server_args(plan, plan.replicas[0], "uid-rm")
    assert args[-2:] == ["--foo", "1"]
    assert re.fullmatch(r"/var/lib/rm/uid-rm/[0-9a-f]{12}/rm-0", _arg(args, "--weights-dir"))
    pod = render_pod(body, plan, plan.replicas[0])
    assert {"name": "persisted-weights", "mountPath": "/var/lib/rm"} in _container(pod)["volumeMounts"]
    assert _arg(_container(pod)["args"], "--weights-dir") == _arg(args, "--weights-dir")


def test_saved_weights_are_bound_to_the_model_uid_and_base_model() -> None:
    """A RewardModel recreated under the same name, or pointed at another base model, never finds
    the weights saved for the earlier one: its replicas save and restore in another directory."""

    def weights_dir_of(body: dict[str, Any]) -> str:
        plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
        return _arg(_container(render_pod(body, plan, plan.replicas[0]))["args"], "--weights-dir")

    sync = {"persistDir": "/var/lib/rm"}
    first = weights_dir_of(cpu_rm(weightSync=sync))
    assert weights_dir_of(cpu_rm(weightSync=sync)) == first  # the same model keeps its directory
    recreated = cpu_rm(weightSync=sync)
    recreated["metadata"]["uid"] = "uid-other"
    other_base = cpu_rm(weightSync=sync, model={"source": "/models/other"})
    other_revision = cpu_rm(weightSync=sync, model={"source": "/models/tiny", "revision": "v2"})
    dirs = {first, weights_dir_of(recreated), weights_dir_of(other_base), weights_dir_of(other_revision)}
    assert len(dirs) == 4


def test_spec_hash_changes_with_the_spec_but_not_with_replicas_or_chosen_node() -> None:
    def first_pod(
        body: dict[str, Any], cluster: ClusterView = ClusterView(nodes=CPU_NODES)
    ) -> dict[str, Any]:
        plan = plan_reward_model(body, cluster)
        return render_pod(body, plan, plan.replicas[0])

    base = first_pod(cpu_rm())
    assert not needs_replacement(base, first_pod(cpu_rm(replicas=3)))
    assert not needs_replacement(base, first_pod(cpu_rm(), ClusterView(nodes=(NodeInfo("other"),))))
    assert needs_replacement(base, first_pod(cpu_rm(model={"source": "/models/other"})))
    assert needs_replacement(base, first_pod(cpu_rm(gpu={"mode": "none", "node": "cpu-a"})))
    unlabeled = copy.deepcopy(base)
    del unlabeled["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    assert needs_replacement(unlabeled, base)


def test_a_pod_whose_labels_were_edited_by_hand_is_replaced() -> None:
    """The Service selects replicas by their labels: a label edited by hand (the spec hash cannot
    show it) takes the Pod out of the Service until it is replaced; a label of someone else's is
    left alone."""
    body = cpu_rm()
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    pod = render_pod(body, plan, plan.replicas[0])
    edited = copy.deepcopy(pod)
    del edited["metadata"]["labels"][LABEL_COMPONENT]
    assert needs_replacement(edited, pod)
    edited = copy.deepcopy(pod)
    edited["metadata"]["labels"][LABEL_MODEL] = "other"
    assert needs_replacement(edited, pod)
    extra = copy.deepcopy(pod)
    extra["metadata"]["labels"]["team"] = "rl"
    assert not needs_replacement(extra, pod)


def test_service_is_headless_and_selects_the_model() -> None:
    body = cpu_rm()
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    svc = render_service(body, plan)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"][LABEL_MODEL] == "rm"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-rm"
    pods, svc2 = render_children(body, plan)
    assert svc2 == svc and [p["metadata"]["name"] for p in pods] == ["rm-0"]


def test_token_secret() -> None:
    token = new_token()
    assert len(token) >= 40 and token != new_token()
    secret = render_token_secret(cpu_rm(), token)
    assert secret["metadata"]["name"] == "rm-control-token"
    assert base64.b64decode(secret["data"]["token"]).decode() == token


# ---------------------------------------------------------------- status


def _pod(
    name: str, index: int, ready: bool = True, ip: str | None = "127.0.0.5", **status: Any
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {LABEL_REPLICA: str(index)},
            "annotations": {
                "rewardplane.io/group-port": str(51217 + index),
                "rewardplane.io/rank-offset": str(index),
            },
        },
        "spec": {"nodeName": "cpu-a"},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **status,
        },
    }


def _status(body: dict[str, Any], pods: list[dict[str, Any]], probes: dict[str, ProbeResult], **kw: Any):
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    return compute_status(body, plan, pods, probes, NOW, **kw)


def _cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_status_ready_with_endpoints() -> None:
    body = cpu_rm(replicas=2)
    probes = {"rm-0": ProbeResult(3, "serving"), "rm-1": ProbeResult(3, "serving")}
    status = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1, ip="127.0.0.6")], probes)
    assert status["phase"] == PHASE_READY and status["readyReplicas"] == 2 and status["ready"] == "2/2"
    assert status["weightsVersion"] == 3 and status["observedGeneration"] == 1
    assert status["endpoints"][1] == {
        "replica": 1,
        "pod": "rm-1",
        "node": "cpu-a",
        "url": "http://127.0.0.6:8001",
        "ncclAddress": "127.0.0.6",
        "groupPort": 51218,
        "rankOffset": 1,
        "worldSize": 1,
        "state": "serving",
        "ready": True,
        "weightsVersion": 3,
        "restarts": 0,
    }
    assert _cond(status, "Available")["status"] == "True" and _cond(status, "Degraded")["status"] == "False"
    assert _cond(status, "Progressing")["status"] == "False"
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])


def test_status_pending_then_progressing() -> None:
    body = cpu_rm(replicas=2)
    status = _status(body, [_pod("rm-0", 0, ready=False)], {})
    assert status["phase"] == PHASE_PENDING and "creating rm-1" in _cond(status, "Progressing")["message"]
    status = _status(body, [_pod("rm-0", 0)], {"rm-0": ProbeResult(0, "serving")})
    assert status["phase"] == PHASE_PROGRESSING and status["ready"] == "1/2"


def test_status_stale_replica_is_taken_out_of_endpoints() -> None:
    body = cpu_rm(replicas=2)
    probes = {"rm-0": ProbeResult(4, "serving"), "rm-1": ProbeResult(0, "serving")}
    status = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1)], probes)
    assert status["weightsVersion"] == 4 and status["readyReplicas"] == 1
    assert [e["ready"] for e in status["endpoints"]] == [True, False]
    assert (
        _cond(status, "WeightsInSync")["status"] == "False"
        and "rm-1" in _cond(status, "WeightsInSync")["message"]
    )


def test_status_broken_server_is_degraded() -> None:
    body = cpu_rm()
    status = _status(body, [_pod("rm-0", 0)], {"rm-0": ProbeResult(1, "broken")})
    assert status["phase"] == PHASE_DEGRADED and _cond(status, "Degraded")["reason"] == "BrokenWeights"
    crashed = _pod("rm-0", 0, ready=False, containerStatuses=[{"restartCount": 2}])
    assert _status(body, [crashed], {})["phase"] == PHASE_DEGRADED


def test_status_outdated_pod_is_progressing() -> None:
    body = cpu_rm()
    pod = _pod("rm-0", 0)
    pod["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = "old"
    status = _status(body, [pod], {"rm-0": ProbeResult(0, "serving")}, desired_hashes={"rm-0": "new"})
    assert status["phase"] == PHASE_PROGRESSING and "replacing rm-0" in status["message"]


def test_status_of_refused_spec_and_events() -> None:
    body = cpu_rm()
    failed = compute_status(
        body, None, [], {}, NOW, errors=["device 0 over-committed"], error_reason="PlacementRefused"
    )
    assert failed["phase"] == PHASE_FAILED
    degraded = _cond(failed, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "PlacementRefused",
        "device 0 over-committed",
    )
    events = transition_events({}, failed)
    assert [(e.type, e.reason) for e in events] == [("Warning", "PlacementRefused")]
    body["status"] = failed
    again = compute_status(
        body,
        None,
        [],
        {},
        "2026-11-26T01:00:00Z",
        errors=["device 0 over-committed"],
        error_reason="PlacementRefused",
    )
    assert transition_events(failed, again) == []  # no event storm while nothing changes
    assert _cond(again, "Degraded")["lastTransitionTime"] == NOW


def test_status_events_on_recovery() -> None:
    ready = _status(cpu_rm(), [_pod("rm-0", 0)], {"rm-0": ProbeResult(0, "serving")})
    events = transition_events({"phase": PHASE_FAILED}, ready)
    assert [(e.type, e.reason) for e in events] == [("Normal", "Ready")]


def test_scaled_to_zero_is_ready() -> None:
    status = _status(cpu_rm(replicas=0), [], {})
    assert status["phase"] == PHASE_READY and _cond(status, "Available")["reason"] == "ScaledToZero"


def test_status_is_json_serialisable() -> None:
    json.dumps(_status(cpu_rm(), [_pod("rm-0", 0)], {"rm-0": ProbeResult(0, "serving")}))


# ---------------------------------------------------------------- rollout steps


def _desired(replicas: int, source: str = "/models/tiny") -> list[dict[str, Any]]:
    body = cpu_rm(replicas=replicas, model={"source": source})
    return render_children(body, plan_reward_model(body, ClusterView(nodes=CPU_NODES)))[0]


def _live(pod: dict[str, Any], ready: bool = True, terminating: bool = False) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if terminating:
        pod["metadata"]["deletionTimestamp"] = NOW
    return pod


def _names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_rollout_creates_missing_pods() -> None:
    actions = pod_actions(_desired(3), [_live(_desired(3)[1])])
    assert _names(actions.create) == ["rm-0", "rm-2"] and actions.delete == []


def test_rollout_scales_down() -> None:
    live = [_live(p) for p in _desired(3)]
    actions = pod_actions(_desired(1), live)
    assert actions.delete == [("rm-1", "scale down"), ("rm-2", "scale down")] and actions.create == []


def test_rollout_waits_for_terminating_pods() -> None:
    desired = _desired(1)
    actions = pod_actions(desired, [_live(desired[0], terminating=True)])
    assert actions.create == [] and actions.delete == []


def test_a_pod_the_kubelet_refused_is_replaced_after_the_grace() -> None:
    from datetime import UTC, datetime, timedelta

    from rewardplane.operator.rollout import ENDED_POD_GRACE_S

    desired = _desired(2)
    live = [_live(p) for p in desired]
    started = datetime(2026, 11, 27, 12, 0, 0, tzinfo=UTC)
    live[1]["status"] = {
        "phase": "Failed",
        "reason": "OutOfcpu",
        "message": "Pod was rejected: Node didn't have enough resource: cpu",
        "startTime": started.isoformat().replace("+00:00", "Z"),
    }
    soon = started + timedelta(seconds=ENDED_POD_GRACE_S / 2)
    later = started + timedelta(seconds=ENDED_POD_GRACE_S + 1)
    assert pod_actions(desired, live, soon).delete == []  # visible first: the status names the cause
    assert pod_actions(desired, live).delete == []  # no clock: nothing judged
    [(name, why)] = pod_actions(desired, live, later).delete
    assert name == "rm-1" and why.startswith("ended (OutOfcpu: Pod was rejected") and "replaced" in why
    # a running Pod of any age stays; an ended one going away is not deleted twice
    live[1]["metadata"]["deletionTimestamp"] = NOW
    assert pod_actions(desired, live, later).delete == []


def test_rollout_replaces_ready_pods_one_at_a_time() -> None:
    live = [_live(p) for p in _desired(3)]
    actions = pod_actions(_desired(3, source="/models/new"), live)
    assert actions.delete == [("rm-0", "spec changed")]
    live[0] = _live(_desired(3, source="/models/new")[0], ready=False)  # its replacement is starting
    assert pod_actions(_desired(3, source="/models/new"), live).delete == []


def test_rollout_replaces_not_ready_outdated_pods_at_once() -> None:
    live = [_live(p, ready=False) for p in _desired(2)]
    actions = pod_actions(_desired(2, source="/models/fixed"), live)
    assert actions.delete == [("rm-0", "spec changed"), ("rm-1", "spec changed")]


def test_rollout_leaves_up_to_date_pods_alone() -> None:
    desired = _desired(2)
    actions = pod_actions(desired, [_live(p) for p in desired])
    assert actions.delete == [] and actions.create == []


def test_a_pod_refused_by_the_kubelet_is_reacted_to_at_once_and_heartbeats_are_not() -> None:
    """A Pod the kubelet refuses (OutOfcpu) turns Failed with nothing else changed: the watch must
    see it (the status names the cause before the Pod is replaced), while a status heartbeat of an
    unchanged Pod must not trigger a reconcile."""
    from rewardplane.operator.pods import watched_state

    body = cpu_rm()
    plan = plan_reward_model(body, ClusterView(nodes=CPU_NODES))
    pending = render_pod(body, plan, plan.replicas[0])
    pending["status"] = {"phase": "Pending"}
    refused = copy.deepcopy(pending)
    refused["status"] = {"phase": "Failed", "reason": "OutOfcpu", "message": "Node didn't have enough cpu"}
    assert watched_state(refused) != watched_state(pending)
    heartbeat = copy.deepcopy(refused)
    heartbeat["status"]["conditions"] = [{"type": "PodScheduled", "status": "True", "lastProbeTime": "now"}]
    assert watched_state(heartbeat) == watched_state(refused)
