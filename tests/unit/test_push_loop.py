"""The push decision loop (pure ``weightsync.step``), the restore plan, and the WeightSync driver
and the reconciler's restore driven against ``FakeReplicas`` and an in-memory API (no servers)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest

from rewardplane.api import weightsync as wsapi
from rewardplane.api.names import LABEL_MODEL, LABEL_REPLICA, core_path, custom_path
from rewardplane.operator import weightsync as wsm
from rewardplane.operator.recovery import restore_plan
from rewardplane.operator.replicas import Receiver, ReplicaError, restore_from_peer
from rewardplane.operator.status import ProbeResult
from rewardplane.operator.weightsync_driver import WeightSyncDriver
from rewardplane.protocol import STALE_BASE, UPDATE_IN_PROGRESS, ParamMeta
from rewardplane.testing.kube import MemoryKube
from rewardplane.testing.replicas import FakeReplica, FakeReplicas

T0, T1 = wsm.Target(0, "rm-0", "u0", 1, 0), wsm.Target(1, "rm-1", "u1", 1, 1)


def transfer(*targets: wsm.Target, deadline: float = 100.0) -> wsm.Transfer:
    return wsm.Transfer(
        version=5, timeout_s=100, nbytes=64, targets=targets or (T0, T1), announced=0.0, deadline=deadline
    )


SERVING = wsm.Observation({"version": 5, "state": "serving"})
BEHIND = wsm.Observation({"version": 4, "state": "updating"}, {"num_background_tasks": 1})
FAILED = wsm.Observation(
    {"version": 4, "state": "serving"}, {"num_background_tasks": 0, "last_error": "boom"}
)


# ---------------------------------------------------------------- step


def test_step_polls_every_target_first_and_only_pending_ones_after() -> None:
    state, polls, outcome = wsm.step(transfer(), {}, 0.0)
    assert [t.pod for t in polls] == ["rm-0", "rm-1"] and outcome is None
    state, polls, outcome = wsm.step(state, {"rm-0": SERVING, "rm-1": BEHIND}, 1.0)
    assert [t.pod for t in polls] == ["rm-1"] and outcome is None
    assert state.entries["rm-0"]["phase"] == "Completed" and state.entries["rm-0"]["durationSeconds"] == 1.0


def test_step_completes_when_every_replica_serves_the_version() -> None:
    state, _, _ = wsm.step(transfer(), {"rm-0": SERVING}, 0.5)
    _, polls, outcome = wsm.step(state, {"rm-1": SERVING}, 2.0)
    assert polls == () and outcome is not None
    assert outcome.phase == "Completed" and outcome.reason is None and outcome.bytes == 64
    assert [r["pod"] for r in outcome.replicas] == ["rm-0", "rm-1"]
    assert outcome.message == "2 replica(s) serve version 5"


def test_step_a_reported_failure_is_replica_failed_with_the_servers_error() -> None:
    state, _, outcome = wsm.step(transfer(), {"rm-0": SERVING, "rm-1": FAILED}, 1.0)
    assert outcome is not None and outcome.phase == "Failed" and outcome.reason == wsapi.REPLICA_FAILED
    assert "rm-1: boom" in outcome.message and outcome.bytes == 0
    assert outcome.replicas[1]["phase"] == "Failed" and outcome.replicas[1]["version"] == 4


def test_step_deadline_is_a_timeout_when_nothing_else_failed() -> None:
    state, _, _ = wsm.step(transfer(deadline=10.0), {"rm-0": SERVING, "rm-1": BEHIND}, 5.0)
    _, polls, outcome = wsm.step(state, {"rm-1": BEHIND}, 10.0)
    assert polls == () and outcome is not None and outcome.reason == wsapi.TIMEOUT
    assert "rm-1: did not serve version 5 within 100s" in outcome.message
    assert outcome.replicas[0]["phase"] == "Completed" and outcome.replicas[1]["message"] == "timed out"


def test_step_mixed_failure_and_timeout_is_replica_failed() -> None:
    _, _, outcome = wsm.step(transfer(deadline=1.0), {"rm-0": FAILED, "rm-1": BEHIND}, 1.0)
    assert outcome is not None and outcome.reason == wsapi.REPLICA_FAILED


def test_step_unanswered_polls_keep_waiting() -> None:
    state, polls, outcome = wsm.step(transfer(), {"rm-0": wsm.Observation(), "rm-1": wsm.Observation()}, 3.0)
    assert outcome is None and len(polls) == 2 and state.entries == {}


# ---------------------------------------------------------------- restore plan


def probes(**versions: int) -> dict[str, ProbeResult]:
    return {pod.replace("_", "-"): ProbeResult(v, "serving") for pod, v in versions.items()}


def test_restore_plan_prefers_saved_weights_then_a_peer() -> None:
    p = probes(rm_0=3, rm_1=0, rm_2=0)
    plan = restore_plan({"rm-1", "rm-2"}, p, 3, persisted=True)
    assert plan.from_disk == ("rm-1", "rm-2") and plan.from_peer == ()
    plan = restore_plan({"rm-1", "rm-2"}, p, 3, persisted=True, disk_failed={"rm-2"})
    assert plan.from_disk == ("rm-1",) and plan.peer_source == "rm-0" and plan.from_peer == ("rm-2",)


def test_restore_plan_without_persist_dir_goes_to_a_peer() -> None:
    plan = restore_plan({"rm-1"}, probes(rm_0=3, rm_1=0), 3, persisted=False)
    assert plan.from_disk == () and (plan.peer_source, plan.from_peer) == ("rm-0", ("rm-1",))


def test_restore_plan_never_copies_from_a_stale_broken_busy_or_older_replica() -> None:
    p = probes(rm_0=2, rm_1=0, rm_2=3, rm_3=3)
    p["rm-2"] = ProbeResult(3, "broken")
    plan = restore_plan({"rm-1"}, p, 3, persisted=False, busy={"rm-3"})
    assert plan.peer_source is None and plan.unrecoverable == ("rm-1",)
    assert restore_plan({"rm-1"}, p, 3, persisted=False).peer_source == "rm-3"


def test_restore_plan_leaves_replicas_with_a_restore_in_flight_alone() -> None:
    plan = restore_plan({"rm-1"}, probes(rm_0=3, rm_1=0), 3, persisted=True, busy={"rm-1"})
    assert plan == type(plan)()


def test_restore_from_peer_ranks_receivers_after_each_other_and_the_source_last() -> None:
    fake = FakeReplicas({"src": FakeReplica(version=3), "a": FakeReplica(), "b": FakeReplica()}, token="t")
    restore_from_peer(
        fake,
        "t",
        source_url="src",
        source_host="10.0.0.9",
        port=51300,
        receivers=[Receiver("a", "a", 2), Receiver("b", "b", 1)],
        version=3,
        timeout_s=30,
        group_id="g",
    )
    assert fake.calls == [
        ("manifest", "src"),
        ("send_weights", "src"),
        ("init_communicator", "a"),
        ("init_communicator", "b"),
        ("update_param_batch", "a"),
        ("update_param_batch", "b"),
    ]
    with pytest.raises(ReplicaError, match="serves version 3, not 4"):
        restore_from_peer(
            fake,
            "t",
            source_url="src",
            source_host="h",
            port=1,
            receivers=[Receiver("a", "a", 1)],
            version=4,
            timeout_s=30,
            group_id="g",
        )


# ---------------------------------------------------------------- the driver, end to end in memory

NS = "ns"


def cluster(replicas: dict[str, FakeReplica], *, version: int = 5) -> tuple[MemoryKube, FakeReplicas]:
    kube = MemoryKube()
    kube.put(
        custom_path(NS),
        {"metadata": {"name": "rm", "namespace": NS}, "spec": {"model": {"source": "/m"}}, "status": {}},
    )
    kube.put(
        core_path("secrets", NS),
        {"metadata": {"name": "rm-control-token"}, "data": {"token": base64.b64encode(b"tok").decode()}},
    )
    data, key, sha = wsapi.encode_manifest([ParamMeta(name="score.weight", dtype="float32", shape=(1, 4))])
    kube.put(core_path("configmaps", NS), {"metadata": {"name": "rm-manifest"}, "data": data})
    for i, url in enumerate(replicas):
        kube.put(
            core_path("pods", NS),
            {
                "metadata": {"name": f"rm-{i}", "labels": {LABEL_MODEL: "rm", LABEL_REPLICA: str(i)}},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8001}]}]},
                "status": {"podIP": url, "conditions": [{"type": "Ready", "status": "True"}]},
            },
        )
    kube.put(
        custom_path(NS, plural=wsapi.WS_PLURAL),
        {
            "metadata": {"name": "rm", "namespace": NS, "generation": 1},
            "spec": {
                "rewardModelRef": "rm",
                "version": version,
                "trainingMode": "full",
                "rendezvous": {"address": "10.0.0.1", "port": 4000},
                "manifestRef": {"configMapName": "rm-manifest", "key": key, "sha256": sha},
                "timeoutSeconds": 60,
            },
        },
    )
    fake = FakeReplicas({f"http://{url}:8001": r for url, r in replicas.items()})
    return kube, fake


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def run_push(kube: MemoryKube, fake: FakeReplicas, **kw: Any) -> dict[str, Any]:
    clock = Clock()
    done: list[tuple[str, str]] = []
    driver = WeightSyncDriver(kube, on_done=done.append, replicas=fake, clock=clock, sleep=clock.sleep, **kw)  # type: ignore[arg-type]
    driver.handle((NS, "rm"))
    assert done == [(NS, "rm")]  # the model is reconciled after every push, whatever its outcome
    ws = kube.get(custom_path(NS, "rm", wsapi.WS_PLURAL))
    assert ws is not None
    return ws["status"]


def test_driver_push_completes_with_ranks_and_bytes() -> None:
    kube, fake = cluster({"a": FakeReplica(polls_until_done=3), "b": FakeReplica(world_size=2)})
    status = run_push(kube, fake)
    assert status["phase"] == "Completed" and status["version"] == 5 and status["worldSize"] == 4
    assert [(r["pod"], r["rankOffset"], r["phase"]) for r in status["replicas"]] == [
        ("rm-0", 0, "Completed"),
        ("rm-1", 1, "Completed"),
    ]
    assert status["bytes"] > 0 and status["history"][-1]["phase"] == "Completed"
    # The phases went Pending → Rendezvous → Transferring → Completed, in that order.
    phases = [p["status"].get("phase") for _, p in kube.patches if p["status"].get("phase")]
    assert phases == ["Pending", "Rendezvous", "Transferring", "Completed"]


def test_driver_replica_refusal_fails_the_push_with_the_servers_words() -> None:
    kube, fake = cluster(
        {"a": FakeReplica(), "b": FakeReplica(refuse={"update_param_batch": "another update"})}
    )
    status = run_push(kube, fake)
    assert status["phase"] == "Failed" and status["reason"] == wsapi.REPLICA_REFUSED
    assert "another update" in status["message"]


class RefusesTheDelta(FakeReplicas):
    """Replica ``a`` refuses the announce (it does not serve the delta's base version); each
    close records the push's phase when it was asked."""

    def __init__(self, replicas: dict[str, FakeReplica], kube: MemoryKube) -> None:
        super().__init__(replicas)
        self.kube = kube
        self.phase_at_close: list[str] = []

    def update_param_batch(self, url: str, token: str, req: Any, timeout_s: float) -> None:
        if url == "http://a:8001":
            self.calls.append(("update_param_batch", url))
            raise ReplicaError(f"{url}/update_param_batch answered 409: serves version 6, not 5", STALE_BASE)
        super().update_param_batch(url, token, req, timeout_s)

    def close_communicator(self, url: str, token: str, group_id: str) -> Any:
        ws = self.kube.get(custom_path(NS, "rm", wsapi.WS_PLURAL)) or {}
        self.phase_at_close.append((ws.get("status") or {}).get("phase", ""))
        return super().close_communicator(url, token, group_id)


def test_driver_refused_announce_frees_every_replica_it_asked_to_join_before_failing() -> None:
    """A push refused at its announce (here a delta on a base the replica no longer serves) left
    the other replicas' joins pending until the push's deadline, so the trainer's next push (a
    full one, at once) was refused by them and timed out. Every replica asked to join now
    leaves or cancels that group before the push is reported Failed."""
    kube, _ = cluster({"a": FakeReplica(), "b": FakeReplica()})
    fake = RefusesTheDelta({"http://a:8001": FakeReplica(), "http://b:8001": FakeReplica()}, kube)
    status = run_push(kube, fake)
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.DELTA_REFUSED)
    assert "not 5" in status["message"]
    assert [c for c in fake.calls if c[0] == "close_communicator"] == [
        ("close_communicator", "http://a:8001"),
        ("close_communicator", "http://b:8001"),
    ]
    assert fake.phase_at_close == ["Rendezvous", "Rendezvous"]  # before the trainer sees Failed
    assert all(r.group is None for r in fake.replicas.values())


def test_driver_update_error_fails_as_replica_failed() -> None:
    kube, fake = cluster(
        {"a": FakeReplica(), "b": FakeReplica(polls_until_done=2, update_error="out of memory")}
    )
    status = run_push(kube, fake)
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.REPLICA_FAILED)
    assert "rm-1: out of memory" in status["message"]


def test_driver_replica_that_never_lands_times_out() -> None:
    kube, fake = cluster({"a": FakeReplica(polls_until_done=10**9)})
    status = run_push(kube, fake)
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.TIMEOUT)
    assert status["durationSeconds"] >= 60


def test_driver_full_push_takes_stale_replicas_along() -> None:
    kube, fake = cluster({"a": FakeReplica(version=4), "b": FakeReplica(version=0)})
    status = run_push(kube, fake, stale_pods=lambda _key: {"rm-1"})
    assert status["phase"] == "Completed" and [r["pod"] for r in status["replicas"]] == ["rm-0", "rm-1"]


def test_driver_resumed_push_fails_with_operator_restarted() -> None:
    kube, fake = cluster({"a": FakeReplica()})
    path = custom_path(NS, "rm", wsapi.WS_PLURAL)
    kube.merge_patch(
        path + "/status", {"status": {"phase": "Rendezvous", "observedGeneration": 1, "version": 5}}
    )
    driver = WeightSyncDriver(kube, replicas=fake)  # type: ignore[arg-type]
    driver.handle((NS, "rm"))
    status = (kube.get(path) or {})["status"]
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.OPERATOR_RESTARTED)
    assert fake.calls == []  # nothing was asked of the replicas


def test_driver_resumed_rendezvous_cancels_the_replicas_joins_of_that_group_only() -> None:
    """The operator died after asking the replicas to join: each would wait for the dead push's
    group until its deadline and refuse the trainer's next push meanwhile. The new operator
    cancels those joins (group-scoped: a replica joining another group is left alone, one that
    does not answer is skipped) and fails the push, so the trainer's second push starts at once."""
    kube, fake = cluster({"a": FakeReplica(), "b": FakeReplica(), "c": FakeReplica()})
    fake.replicas["http://a:8001"].group = "rm-g1"
    fake.replicas["http://b:8001"].group = "someone-else"
    fake.replicas["http://c:8001"].answers = False
    path = custom_path(NS, "rm", wsapi.WS_PLURAL)
    targets = [wsm.Target(i, f"rm-{i}", f"http://{u}:8001", 1, i + 1) for i, u in enumerate("abc")]
    kube.merge_patch(
        path + "/status",
        {
            "status": {
                "phase": "Rendezvous",
                "observedGeneration": 1,
                "version": 5,
                "groupId": "rm-g1",
                "replicas": [wsm.replica_entry(t, "Rendezvous") for t in targets],
            }
        },
    )
    WeightSyncDriver(kube, replicas=fake).handle((NS, "rm"))  # type: ignore[arg-type]
    status = (kube.get(path) or {})["status"]
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.OPERATOR_RESTARTED)
    assert [c for c in fake.calls if c[0] == "close_communicator"] == [
        ("close_communicator", f"http://{u}:8001") for u in "abc"
    ]
    assert fake.replicas["http://a:8001"].group is None  # its join of the dead push's group: cancelled
    assert fake.replicas["http://b:8001"].group == "someone-else"  # another group's: untouched
    assert not any(call == "init_communicator" for call, _ in fake.calls)  # nothing was pushed


def test_driver_resumed_transfer_is_followed_to_completion() -> None:
    """The operator died while replicas received: the new one watches them land and completes it."""
    kube, fake = cluster({"a": FakeReplica(), "b": FakeReplica()})
    path = custom_path(NS, "rm", wsapi.WS_PLURAL)
    entries = [
        wsm.replica_entry(t, "Transferring")
        for t in (wsm.Target(0, "rm-0", "http://a:8001", 1, 0), wsm.Target(1, "rm-1", "http://b:8001", 1, 1))
    ]
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    kube.merge_patch(
        path + "/status",
        {
            "status": {
                "phase": "Transferring",
                "observedGeneration": 1,
                "version": 5,
                "replicas": entries,
                "startedAt": started,
            }
        },
    )
    fake.replicas["http://b:8001"].version = 5  # one landed while no operator watched
    fake.replicas["http://a:8001"]._pending = 5  # the other is still receiving
    clock = Clock()
    WeightSyncDriver(kube, replicas=fake, clock=clock, sleep=clock.sleep).handle((NS, "rm"))  # type: ignore[arg-type]
    status = (kube.get(path) or {})["status"]
    assert status["phase"] == "Completed" and [r["phase"] for r in status["replicas"]] == ["Completed"] * 2
    assert not any(call == "init_communicator" for call, _ in fake.calls)  # nothing was pushed again


# ---------------------------------------------------------------- the reconciler's restore, in memory


def test_reconciler_brings_a_new_replica_to_the_models_version_from_a_peer() -> None:
    """Scale 1 → 2 without persistDir: the new replica serves base weights and is not admitted;
    the operator has the healthy one send it the current version, follows the copy, reconciles the
    moment it lands and admits the replica: the model becomes Ready without the trainer."""
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    _put_model(kube, replicas=2, version=3)
    fake = FakeReplicas(
        {
            "http://10.0.0.10:8001": FakeReplica(version=3),
            "http://10.0.0.11:8001": FakeReplica(admitted=False, polls_until_done=2),
        }
    )
    later: list[Callable[[], None]] = []  # follow-up work the reconciler hands off
    reconciler = Reconciler(kube, replicas=fake, later=lambda _delay, work: later.append(work))  # type: ignore[arg-type]
    reconciler.reconcile((NS, "rm"))  # creates the Pods and the token Secret
    secret = kube.get(core_path("secrets", NS, "rm-control-token")) or {}
    fake.token = base64.b64decode(secret["data"]["token"]).decode()  # what the servers were given
    for i in range(2):
        path = core_path("pods", NS, f"rm-{i}")
        kube.merge_patch(
            path + "/status",
            {"status": {"podIP": f"10.0.0.1{i}", "conditions": [{"type": "Ready", "status": "True"}]}},
        )
    reconciler.reconcile((NS, "rm"))
    assert ("send_weights", "http://10.0.0.10:8001") in fake.calls
    assert ("update_param_batch", "http://10.0.0.11:8001") in fake.calls
    status = (kube.get(custom_path(NS, "rm")) or {})["status"]
    assert status["phase"] == "Progressing" and status["readyReplicas"] == 1
    events = [e["reason"] for e in kube.list(core_path("events", NS))]
    assert "ReplicaStale" in events and "ReplicaRestoring" in events
    assert ("admission", "http://10.0.0.11:8001") not in fake.calls  # base weights: kept out

    # A second pass while the copy is in flight starts no second one.
    sends = fake.calls.count(("send_weights", "http://10.0.0.10:8001"))
    fake.replicas["http://10.0.0.11:8001"].polls_until_done = 10**9
    reconciler.reconcile((NS, "rm"))
    assert fake.calls.count(("send_weights", "http://10.0.0.10:8001")) == sends

    # The copy lands: the watcher handed off with the restore sees it and reconciles by itself.
    fake.replicas["http://10.0.0.11:8001"].polls_until_done = 0
    assert len(later) == 1
    later.pop()()
    assert fake.replicas["http://10.0.0.11:8001"].admitted
    status = (kube.get(custom_path(NS, "rm")) or {})["status"]
    assert status["phase"] == "Ready" and status["readyReplicas"] == 2 and status["weightsVersion"] == 3


# ---------------------------------------------------------------- admission (pure)


def test_admission_admits_replicas_on_the_models_version_and_takes_back_stale_ones() -> None:
    from rewardplane.operator.recovery import admission_changes
    from rewardplane.operator.status import ProbeResult

    probes = {
        "new-current": ProbeResult(version=5, state="serving", admitted=False),
        "new-behind": ProbeResult(version=0, state="serving", admitted=False),
        "broken": ProbeResult(version=5, state="broken", admitted=False),
        "admitted": ProbeResult(version=5, state="serving", admitted=True),
        "left-out": ProbeResult(version=4, state="serving", admitted=True),
        "mid-push": ProbeResult(version=4, state="updating", admitted=True),
        "silent": ProbeResult(error="ConnectError"),
    }
    changes = admission_changes(probes, target=5, stale={"new-behind", "left-out"})
    assert changes.admit == ("new-current",)
    # Only a stale replica loses its admission: one a version behind while a push commits is not.
    assert changes.revoke == ("left-out",)


def test_a_replica_left_out_of_a_completed_push_is_stale_even_without_a_restart() -> None:
    from rewardplane.operator.recovery import identity, stale_replicas
    from rewardplane.operator.status import ProbeResult

    pod = {"metadata": {"name": "rm-1", "uid": "u1"}, "status": {"containerStatuses": [{"restartCount": 0}]}}
    seen = {"rm-1": identity(pod)}  # it served the model's version before, same process
    probes = {"rm-1": ProbeResult(version=4, state="serving")}
    stale, _ = stale_replicas([pod], probes, target=5, current=seen)  # a push to 5 in flight
    assert stale == set()
    stale, _ = stale_replicas([pod], probes, target=5, current=seen, completed=5)  # push 5 done
    assert stale == {"rm-1"}


# ---------------------------------------------------------------- weights never silently lost


def test_restore_plan_takes_the_pods_own_copy_after_a_container_restart() -> None:
    plan = restore_plan({"rm-0"}, probes(rm_0=0), 3, persisted=False, pod_copies={"rm-0"})
    assert plan.from_disk == ("rm-0",) and plan.unrecoverable == ()
    # the copy failed (or the Pod is new): nothing else serves version 3 → lost
    plan = restore_plan(
        {"rm-0"}, probes(rm_0=0), 3, persisted=False, pod_copies={"rm-0"}, disk_failed={"rm-0"}
    )
    assert plan.unrecoverable == ("rm-0",)


def _put_model(kube: MemoryKube, *, replicas: int = 1, version: int = 4, **weight_sync: Any) -> None:
    """A node and a RewardModel on CPU whose status says weights ``version``."""
    kube.put(
        core_path("nodes"),
        {"metadata": {"name": "cpu-a"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
    )
    kube.put(
        custom_path(NS),
        {
            "metadata": {"name": "rm", "namespace": NS, "uid": "uid-1", "generation": 1},
            "spec": {
                "model": {"source": "/m"},
                "engine": {"kind": "hf", "image": "localhost/rewardplane/reward-server:test"},
                "gpu": {"mode": "none"},
                "replicas": replicas,
                "weightSync": weight_sync,
            },
            "status": {"weightsVersion": version},
        },
    )


def _restarted(kube: MemoryKube, restarts: int) -> None:
    kube.merge_patch(
        core_path("pods", NS, "rm-0") + "/status",
        {
            "status": {
                "podIP": "10.0.0.10",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"restartCount": restarts, "started": True, "ready": False}],
            }
        },
    )


def test_a_single_replica_restarted_in_its_pod_is_restored_from_its_own_copy() -> None:
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    _put_model(kube)  # no persistDir: podCopy (the default) keeps the weights in the Pod
    fake = FakeReplicas({"http://10.0.0.10:8001": FakeReplica(version=0, admitted=False, saved_version=4)})
    reconciler = Reconciler(kube, replicas=fake, later=lambda _d, _w: None)  # type: ignore[arg-type]
    reconciler.reconcile((NS, "rm"))
    pod = kube.get(core_path("pods", NS, "rm-0")) or {}
    container = pod["spec"]["containers"][0]
    assert container["args"][container["args"].index("--weights-dir") + 1] == "/rewardplane-weights"
    assert {"name": "persisted-weights", "emptyDir": {}} in pod["spec"]["volumes"]
    fake.token = base64.b64decode(
        (kube.get(core_path("secrets", NS, "rm-control-token")) or {})["data"]["token"]
    ).decode()
    _restarted(kube, restarts=1)
    reconciler.reconcile((NS, "rm"))
    assert ("restore_weights", "http://10.0.0.10:8001") in fake.calls
    reconciler.reconcile((NS, "rm"))  # the next pass sees version 4 and admits it
    assert fake.replicas["http://10.0.0.10:8001"].admitted


def test_weights_nothing_can_restore_are_reported_lost_not_restoring() -> None:
    """A new Pod (no copy of its own), no persistDir, no other replica: the status says the
    weights are lost and to push again, instead of "bringing rm-0 to version 4"."""
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    _put_model(kube)
    fake = FakeReplicas({"http://10.0.0.10:8001": FakeReplica(version=0, admitted=False)})
    reconciler = Reconciler(kube, replicas=fake, later=lambda _d, _w: None)  # type: ignore[arg-type]
    reconciler.reconcile((NS, "rm"))
    fake.token = base64.b64decode(
        (kube.get(core_path("secrets", NS, "rm-control-token")) or {})["data"]["token"]
    ).decode()
    _restarted(kube, restarts=0)
    reconciler.reconcile((NS, "rm"))
    status = (kube.get(custom_path(NS, "rm")) or {})["status"]
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (status["phase"], status["reason"], degraded["reason"]) == (
        "Degraded",
        "WeightsLost",
        "WeightsLost",
    )
    assert "lost weights version 4" in degraded["message"] and "push version 4 again" in degraded["message"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] != "RestoringWeights"
    assert ("admission", "http://10.0.0.10:8001") not in fake.calls  # base weights stay out

    from rewardplane.sdk.cluster import ClusterError, RewardModelHandle

    handle = RewardModelHandle("rm", NS, kube=kube)  # type: ignore[arg-type]
    with pytest.raises(ClusterError, match="will not become ready by itself: rm-0 lost weights version 4"):
        handle.wait_ready(timeout_s=30)


def test_no_pod_copy_when_turned_off() -> None:
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    _put_model(kube, podCopy=False)
    Reconciler(kube, replicas=FakeReplicas(), later=lambda _d, _w: None).reconcile((NS, "rm"))  # type: ignore[arg-type]
    pod = kube.get(core_path("pods", NS, "rm-0")) or {}
    assert "--weights-dir" not in pod["spec"]["containers"][0]["args"]
    assert all(v["name"] != "persisted-weights" for v in pod["spec"]["volumes"])


def test_replicas_that_turn_stale_one_after_the_other_are_restored_one_after_the_other() -> None:
    """Scale 1 → 3 where the second new replica comes up while the first is being copied to: the
    source would refuse a second send (409), so the operator waits for the first copy to land (its
    watcher reconciles) and then starts the next, with no RestoreFailed and no 30 s retry."""
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    _put_model(kube, replicas=3, version=3)
    urls = [f"http://10.0.0.1{i}:8001" for i in range(3)]
    fake = FakeReplicas(
        {
            urls[0]: FakeReplica(version=3),
            urls[1]: FakeReplica(admitted=False, polls_until_done=2),
            urls[2]: FakeReplica(admitted=False, answers=False),  # still starting
        }
    )
    later: list[Callable[[], None]] = []
    reconciler = Reconciler(kube, replicas=fake, later=lambda _d, work: later.append(work))  # type: ignore[arg-type]
    reconciler.reconcile((NS, "rm"))
    fake.token = base64.b64decode(
        (kube.get(core_path("secrets", NS, "rm-control-token")) or {})["data"]["token"]
    ).decode()
    for i in range(3):
        kube.merge_patch(
            core_path("pods", NS, f"rm-{i}") + "/status",
            {
                "status": {
                    "podIP": f"10.0.0.1{i}",
                    "conditions": [{"type": "Ready", "status": "True" if i == 0 else "False"}],
                    "containerStatuses": [{"restartCount": 0, "started": True}],
                }
            },
        )
    reconciler.reconcile((NS, "rm"))  # copies to rm-1
    assert fake.calls.count(("send_weights", urls[0])) == 1
    fake.replicas[urls[2]].answers = True  # rm-2 is up now, while rm-1's copy is in flight
    reconciler.reconcile((NS, "rm"))
    assert fake.calls.count(("send_weights", urls[0])) == 1  # waits: the source is sending
    while later:  # the copy to rm-1 lands; its watcher reconciles, which starts rm-2's
        fake.replicas[urls[1]].polls_until_done = 0
        fake.replicas[urls[2]].polls_until_done = 0
        later.pop(0)()
    assert fake.calls.count(("send_weights", urls[0])) == 2
    assert fake.replicas[urls[1]].admitted and fake.replicas[urls[2]].admitted
    assert "RestoreFailed" not in [e["reason"] for e in kube.list(core_path("events", NS))]


def test_a_status_field_that_is_no_longer_true_is_removed() -> None:
    """A merge patch keeps what it does not name: the REASON of a Degraded model must not stay
    on once it is Ready."""
    from rewardplane.operator.reconcile import Reconciler

    kube = MemoryKube()
    kube.put(custom_path(NS), {"metadata": {"name": "rm", "namespace": NS}, "spec": {}})
    reconciler = Reconciler(kube, replicas=FakeReplicas(), later=lambda _d, _w: None)  # type: ignore[arg-type]
    reconciler._write_status(
        kube.get(custom_path(NS, "rm")) or {}, {"phase": "Degraded", "reason": "OOMKilled"}
    )
    reconciler._write_status(kube.get(custom_path(NS, "rm")) or {}, {"phase": "Ready"})
    status = (kube.get(custom_path(NS, "rm")) or {})["status"]
    # what the operator computed, beside its heartbeat (status.confirmedAt)
    assert {k: v for k, v in status.items() if k not in ("confirmedAt", "confirmIntervalSeconds")} == {
        "phase": "Ready"
    }


class EndingAnUpdate(FakeReplicas):
    """Replica ``a`` still ends the update of an earlier push (its operator died): it refuses to
    join, as a real server does, and reports a background task for ``polls`` more polls."""

    def __init__(self, replicas: dict[str, FakeReplica], polls: int) -> None:
        super().__init__(replicas)
        self.polls = polls

    def background_tasks(self, url: str, token: str) -> dict[str, Any]:
        self._get("background_tasks", url, token)
        busy = url == "http://a:8001" and self.polls > 0
        self.polls -= busy
        return {"num_background_tasks": int(busy), "last_error": None}

    def init_communicator(self, url: str, token: str, req: Any) -> None:
        if url == "http://a:8001" and self.polls > 0:
            self.calls.append(("init_communicator", url))
            raise ReplicaError(
                f"{url}/init_communicator answered 409: a weight update is in progress; wait for it "
                "(GET /get_num_background_tasks) and retry"
            )
        super().init_communicator(url, token, req)


def test_driver_waits_for_a_replica_ending_an_earlier_update_then_pushes() -> None:
    """The trainer pushes again right after a push failed with OperatorRestarted: a replica still
    ends that push's update for a moment. The new push waits for it (the status says so) instead
    of failing with ReplicaRefused, then completes."""
    kube, _ = cluster({"a": FakeReplica(), "b": FakeReplica()})
    fake = EndingAnUpdate({"http://a:8001": FakeReplica(), "http://b:8001": FakeReplica()}, polls=3)
    status = run_push(kube, fake)
    assert status["phase"] == "Completed", status
    assert [c for c in fake.calls if c[0] == "init_communicator"].count(
        ("init_communicator", "http://a:8001")
    ) == 4
    messages = [p["status"].get("message") for _, p in kube.patches if "message" in p["status"]]
    assert any(m and "waiting for rm-0 to end an earlier update" in m for m in messages), messages


class UpdateJustEnded(FakeReplicas):
    """Replica ``a`` refuses the first join because an update runs, and that update has ended by
    the time the operator asks whether one runs (it reports no background task)."""

    def init_communicator(self, url: str, token: str, req: Any) -> None:
        if url == "http://a:8001" and ("init_communicator", url) not in self.calls:
            self.calls.append(("init_communicator", url))
            raise ReplicaError(
                f"{url}/init_communicator answered 409: a weight update is in progress", UPDATE_IN_PROGRESS
            )
        super().init_communicator(url, token, req)


def test_driver_asks_again_when_the_update_that_refused_the_join_has_just_ended() -> None:
    kube, _ = cluster({"a": FakeReplica()})
    fake = UpdateJustEnded({"http://a:8001": FakeReplica()})
    status = run_push(kube, fake)
    assert status["phase"] == "Completed", status
    assert fake.calls.count(("init_communicator", "http://a:8001")) == 2


def test_driver_fails_at_once_when_an_idle_replica_refuses_to_join() -> None:
    """A refusal with no update running (a pending join of a group that never formed, say) is no
    reason to wait: ReplicaRefused at once, its answer in the message."""
    kube, fake = cluster({"a": FakeReplica(refuse={"init_communicator": "a join is pending"})})
    status = run_push(kube, fake)
    assert (status["phase"], status["reason"]) == ("Failed", wsapi.REPLICA_REFUSED)
    assert "a join is pending" in status["message"]
    assert fake.calls.count(("init_communicator", "http://a:8001")) == 1
