"""Every condition and message of a RewardModel's status says what is true of the state it describes.

One test per statement the status used to get wrong, plus the crash cause a Degraded replica names.
"""

from __future__ import annotations

from typing import Any

import pytest

from rewardplane.api.status import PHASE_FAILED, PHASE_PROGRESSING, PHASE_READY
from rewardplane.operator.conditions import compute_status
from rewardplane.operator.planning import ClusterView, NodeInfo, plan_reward_model
from rewardplane.operator.status import (
    ProbeResult,
    replica_problem,
    restore_failed_message,
    transition_events,
)

from .test_planning import NOW, _cond, _pod, _status, cpu_rm, rm


def test_available_false_never_says_replicas_ready() -> None:
    body = cpu_rm(replicas=2)
    status = _status(body, [_pod("rm-0", 0, ready=False), _pod("rm-1", 1, ready=False)], {})
    available = _cond(status, "Available")
    assert (available["status"], available["reason"]) == ("False", "NoReplicaReady")
    assert available["message"] == "0/2 replicas ready"
    ready = _status(
        body, [_pod("rm-0", 0), _pod("rm-1", 1, ready=False)], {"rm-0": ProbeResult(0, "serving")}
    )
    assert (_cond(ready, "Available")["status"], _cond(ready, "Available")["reason"]) == (
        "True",
        "ReplicasReady",
    )


def test_weights_in_sync_is_false_without_replicas() -> None:
    for replicas, pods in ((1, []), (0, [])):
        status = _status(cpu_rm(replicas=replicas), pods, {})
        in_sync = _cond(status, "WeightsInSync")
        assert (in_sync["status"], in_sync["reason"]) == ("False", "NoReplicas"), replicas


def test_progressing_stays_true_while_a_replica_waits_for_the_weights() -> None:
    # Both Pods exist and run, one serves an older version: the phase is Progressing, and so
    # must the condition be (it used to say RolloutComplete at 1/2).
    body = cpu_rm(replicas=2)
    probes = {"rm-0": ProbeResult(3, "serving"), "rm-1": ProbeResult(0, "serving")}
    status = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1)], probes)
    assert status["phase"] == PHASE_PROGRESSING and status["ready"] == "1/2"
    progressing = _cond(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RestoringWeights")
    assert "rm-1" in progressing["message"] and "version 3" in progressing["message"]
    # A replica the reconciler marked stale (restarted onto base weights) counts the same way.
    probes["rm-1"] = ProbeResult(3, "serving")
    marked = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1)], probes, target_version=3, stale_pods={"rm-1"})
    assert marked["phase"] == PHASE_PROGRESSING
    assert _cond(marked, "Progressing")["status"] == "True"
    assert _cond(marked, "WeightsInSync")["status"] == "False"
    # When every replica is Ready, rollout is complete.
    probes["rm-1"] = ProbeResult(3, "serving")
    done = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1)], probes)
    assert done["phase"] == PHASE_READY
    assert (_cond(done, "Progressing")["status"], _cond(done, "Progressing")["reason"]) == (
        "False",
        "RolloutComplete",
    )


def test_gpu_fraction_is_reported_only_for_models_on_gpus() -> None:
    cpu = _status(cpu_rm(), [_pod("rm-0", 0)], {"rm-0": ProbeResult(0, "serving")})
    assert "gpuMemoryFraction" not in cpu
    body = rm(gpu={"mode": "exclusive", "memoryFraction": 0.6})
    plan = plan_reward_model(body, ClusterView(nodes=(NodeInfo("gpu-1", gpus=1),)))
    gpu = compute_status(body, plan, [], {}, NOW)
    assert gpu["gpuMemoryFraction"] == 0.6


def test_refused_spec_message_matches_what_the_operator_does() -> None:
    placement = compute_status(
        cpu_rm(), None, [], {}, NOW, errors=["device 0 over-committed"], error_reason="PlacementRefused"
    )
    assert placement["phase"] == PHASE_FAILED
    message = _cond(placement, "Progressing")["message"]
    # Placement is retried by the periodic reconcile: the status must not claim it stopped.
    assert "stopped" not in message and "checked again periodically" in message
    invalid = compute_status(cpu_rm(), None, [], {}, NOW, errors=["bad dtype"], error_reason="InvalidSpec")
    assert "fix the spec" in _cond(invalid, "Progressing")["message"]


def test_restore_hint_does_not_suggest_what_is_already_set() -> None:
    with_dir = restore_failed_message("rm-1", 4, "no persisted weights", "/var/lib/rp")
    assert "persistDir" not in with_dir and "peer" in with_dir and "full push" in with_dir
    without = restore_failed_message("rm-1", 4, "this server persists no weights", None)
    assert "set spec.weightSync.persistDir" in without


def _crashed(message: str | None, restarts: int = 3) -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": 2, "reason": "Error"}
    if message is not None:
        terminated["message"] = message
    return _pod(
        "rm-0",
        0,
        ready=False,
        containerStatuses=[
            {
                "restartCount": restarts,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": terminated},
            }
        ],
    )


def test_degraded_names_the_crash_cause_from_the_termination_message() -> None:
    log_tail = (
        "INFO loading\nERROR model not found at /models/missing: no such directory; fix spec.model.source\n"
    )
    status = _status(cpu_rm(), [_crashed(log_tail)], {})
    degraded = _cond(status, "Degraded")
    assert degraded["status"] == "True"
    assert "model not found at /models/missing" in degraded["message"]
    assert "exited with code 2" in degraded["message"] and "3 restart(s)" in degraded["message"]
    assert "back off" in degraded["message"]
    [event] = transition_events({}, status)
    assert event.type == "Warning" and "model not found at /models/missing" in event.message
    assert "crashed or report a broken server" not in degraded["message"]


def test_replica_problem_without_a_termination_message_still_gives_the_exit_code() -> None:
    assert replica_problem(_crashed(None), None).startswith("rm-0: the server exited with code 2")
    broken = replica_problem(_pod("rm-0", 0), ProbeResult(1, "broken"))
    assert "broken weights" in broken and "full push" in broken


def test_long_termination_messages_are_cut_to_their_end() -> None:
    text = replica_problem(_crashed("x" * 5000 + "\nthe real cause"), None)
    assert text.endswith("the real cause; 3 restart(s); restarts back off exponentially (CrashLoopBackOff)")
    assert len(text) < 500


def test_without_a_termination_message_the_hint_says_where_the_log_is() -> None:
    pod = _crashed(None)
    pod["metadata"] |= {"namespace": "team", "uid": "0123456789abcdef"}
    assert "kubectl logs -n team rm-0 --previous" in replica_problem(pod, None)
    # The local node agent runs Pods as processes: kubectl logs cannot reach them; name the file.
    pod["status"]["containerStatuses"][0]["containerID"] = "rewardplane-node://4242"
    local = replica_problem(pod, None)
    assert "kubectl logs" not in local and "pods/team_rm-0_01234567/reward-server.log" in local
    # With the cause at hand there is nothing to look up.
    assert "its log" not in replica_problem(_crashed("model not found at /m"), None)


# ---------------------------------------------------------------- every cause named


def _waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"image": "img:1", "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}}


CAUSES = [
    (
        "ImagePullBackOff",
        {"containerStatuses": [_waiting("ImagePullBackOff", 'Back-off pulling image "img:1"')]},
        {},
        "img:1",
    ),
    (
        "ImagePullBackOff",
        {"containerStatuses": [_waiting("ErrImagePull", "not found")]},
        {},
        "spec.engine.image",
    ),
    (
        "CreateContainerConfigError",
        {"containerStatuses": [_waiting("CreateContainerConfigError", 'secret "hf-token" not found')]},
        {},
        'secret "hf-token" not found',
    ),
    (
        "Unschedulable",
        {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 Insufficient cpu.",
                }
            ]
        },
        {},
        "Insufficient cpu",
    ),
    (
        "Unschedulable",
        {"phase": "Failed", "reason": "OutOfcpu", "message": "Node didn't have enough resource: cpu"},
        {},
        "OutOfcpu",
    ),
    (
        "OOMKilled",
        {
            "containerStatuses": [
                {
                    "restartCount": 2,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
                }
            ]
        },
        {},
        "spec.resources.limits.memory",
    ),
    (
        "ModelUnreadable",
        {
            "containerStatuses": [
                {
                    "restartCount": 1,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 2,
                            "message": "model files unreadable: /mnt/models/config.json (mode -rw------- (600), owner uid 0 gid 0) cannot be read",
                        }
                    },
                }
            ]
        },
        {},
        "/mnt/models/config.json",
    ),
    (
        "CrashLoopBackOff",
        {
            "containerStatuses": [
                {
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "message": "ValueError: boom"}},
                }
            ]
        },
        {},
        "ValueError: boom",
    ),
    (
        "ModelDownloadFailed",
        {
            "initContainerStatuses": [
                {
                    "name": "fetch-model",
                    "restartCount": 1,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 2,
                            "message": "s3://models/rm-7b: no objects under this prefix; check the prefix",
                        }
                    },
                }
            ],
            "containerStatuses": [_waiting("PodInitializing")],
        },
        {},
        "no objects under this prefix",
    ),
    (
        "FailedMount",
        {"containerStatuses": [_waiting("ContainerCreating")]},
        {
            "rm-0": 'MountVolume.SetUp failed for volume "model" : hostPath type check failed: /models/x is not a directory'
        },
        "/models/x is not a directory",
    ),
]


@pytest.mark.parametrize(("reason", "pod_status", "mounts", "needle"), CAUSES)
def test_each_cause_is_named_in_the_reason_the_condition_and_the_message(
    reason: str, pod_status: dict[str, Any], mounts: dict[str, str], needle: str
) -> None:
    pod = _pod("rm-0", 0, ready=False, **pod_status)
    pod["spec"]["containers"] = [{"resources": {"limits": {"memory": "256Mi"}}}]
    status = _status(cpu_rm(), [pod], {}, mount_problems=mounts)
    degraded = _cond(status, "Degraded")
    assert (status["phase"], status["reason"], degraded["status"], degraded["reason"]) == (
        "Degraded",
        reason,
        "True",
        reason,
    )
    assert needle in degraded["message"] and "rm-0" in degraded["message"]
    [event] = transition_events({}, status)
    assert (event.type, event.reason) == ("Warning", reason) and needle in event.message


def test_a_replica_still_starting_names_no_cause() -> None:
    status = _status(
        cpu_rm(), [_pod("rm-0", 0, ready=False, containerStatuses=[_waiting("ContainerCreating")])], {}
    )
    assert status["phase"] == "Pending" and _cond(status, "Degraded")["status"] == "False"
    assert status["reason"] == "RollingOut"


def test_the_oom_message_names_the_memory_limit() -> None:
    [(_, pod_status, _, _)] = [c for c in CAUSES if c[0] == "OOMKilled"]
    pod = _pod("rm-0", 0, ready=False, **pod_status)
    pod["spec"]["containers"] = [{"resources": {"limits": {"memory": "256Mi"}}}]
    assert "256Mi" in _cond(_status(cpu_rm(), [pod], {}), "Degraded")["message"]
