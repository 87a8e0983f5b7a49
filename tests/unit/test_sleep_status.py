"""A RewardModel whose replicas sleep (POST /sleep) shows it: phase Sleeping when every ready
replica sleeps, the level on each endpoint, and an Available condition that says how to wake them.
A sleeping replica stays ready (the SDK must reach it to wake it) and is never a peer-restore source."""

from __future__ import annotations

from rewardplane.api.status import PHASE_READY, PHASE_SLEEPING, RewardModelStatus
from rewardplane.operator.recovery import restore_plan
from rewardplane.operator.status import ProbeResult, transition_events
from rewardplane.testing.replicas import FakeReplica, FakeReplicas

from .test_planning import _cond, _pod, _status, cpu_rm


def _probes(*replicas: FakeReplica) -> dict[str, ProbeResult]:
    fake = FakeReplicas({f"http://rm-{i}": r for i, r in enumerate(replicas)})
    return {f"rm-{i}": fake.probe(f"http://rm-{i}") for i in range(len(replicas))}


def test_every_replica_asleep_is_phase_sleeping_and_says_how_to_wake() -> None:
    body = cpu_rm(replicas=2)
    probes = _probes(
        FakeReplica(version=3, state="sleeping", sleep_level=1),
        FakeReplica(version=3, state="sleeping", sleep_level=1),
    )
    assert probes["rm-0"].sleep_level == 1  # the probe carries the level /runtime_version reports
    status = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1, ip="127.0.0.6")], probes)
    assert status["phase"] == PHASE_SLEEPING and status["ready"] == "2/2"
    available = _cond(status, "Available")
    assert (available["status"], available["reason"]) == ("False", "Sleeping")
    assert "sleep level 1" in available["message"] and "handle.awake()" in available["message"]
    assert status["message"] == available["message"]
    assert [(e["state"], e["sleepLevel"], e["ready"]) for e in status["endpoints"]] == [
        ("sleeping", 1, True),
        ("sleeping", 1, True),
    ]
    # readers (the SDK) see it typed
    parsed = RewardModelStatus.parse(status)
    assert parsed.phase == "Sleeping" and [e.sleep_level for e in parsed.ready_endpoints()] == [1, 1]
    # going to sleep and waking are Normal events, not warnings
    ready = _status(
        body, [_pod("rm-0", 0), _pod("rm-1", 1, ip="127.0.0.6")], _probes(FakeReplica(3), FakeReplica(3))
    )
    assert [(e.type, e.reason) for e in transition_events(ready, status)] == [("Normal", "Sleeping")]
    assert [(e.type, e.reason) for e in transition_events(status, ready)] == [("Normal", "Ready")]


def test_some_replicas_asleep_stay_ready_and_are_named() -> None:
    body = cpu_rm(replicas=2)
    probes = _probes(FakeReplica(version=2), FakeReplica(version=2, state="sleeping", sleep_level=2))
    status = _status(body, [_pod("rm-0", 0), _pod("rm-1", 1, ip="127.0.0.6")], probes)
    assert status["phase"] == PHASE_READY
    available = _cond(status, "Available")
    assert (available["status"], available["message"]) == ("True", "2/2 replicas ready; rm-1 asleep")
    assert "sleepLevel" not in status["endpoints"][0] and status["endpoints"][1]["sleepLevel"] == 2


def test_a_sleeping_replica_is_never_the_source_of_a_peer_restore() -> None:
    probes = {
        "rm-0": ProbeResult(3, "sleeping", sleep_level=1),
        "rm-1": ProbeResult(0, "serving"),
    }
    plan = restore_plan({"rm-1"}, probes, 3, persisted=False)
    assert plan.peer_source is None and plan.unrecoverable == ("rm-1",)
    probes["rm-2"] = ProbeResult(3, "serving")
    assert restore_plan({"rm-1"}, probes, 3, persisted=False).peer_source == "rm-2"
