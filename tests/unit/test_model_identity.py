"""Pure decisions behind "a new object is a new model", one push per model, the heartbeat and the
truthful messages: ownership by UID, the wipe Pod, the status texts (no sockets, no cluster)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from rewardplane.api import heartbeat
from rewardplane.operator import weightsync as wsm
from rewardplane.operator.cluster import freshest
from rewardplane.operator.ownership import belongs_to, of_model
from rewardplane.operator.retire import WIPE_MOUNT, wipe_finished, wipe_pod, wipe_pod_name
from rewardplane.operator.status import ProbeResult, mount_problem, node_paths, transition_events
from rewardplane.operator.weightsync import completed_version

from .test_planning import _cond, _pod, _status, cpu_rm

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def _owned(uid: str | None, created: str = "2026-11-26T00:00:00Z", **body: Any) -> dict[str, Any]:
    refs = [{"kind": "RewardModel", "name": "rm", "uid": uid}] if uid else []
    return {"metadata": {"name": "rm", "ownerReferences": refs, "creationTimestamp": created}, **body}


def _completed(version: int, uid: str | None, created: str = "2026-11-26T00:00:00Z") -> dict[str, Any]:
    return _owned(
        uid, created, spec={"rewardModelRef": "rm"}, status={"phase": "Completed", "version": version}
    )


def test_an_earlier_objects_pods_and_pushes_do_not_count_for_a_new_object() -> None:
    old, new = cpu_rm(), cpu_rm()
    new["metadata"]["uid"], new["metadata"]["creationTimestamp"] = "uid-new", "2026-11-27T00:00:00Z"
    pushes = [_completed(3, "uid-rm"), _completed(1, "uid-new")]
    # the old object's completed push of version 3 is not the new object's version
    assert completed_version(of_model(pushes, old), "rm") == 3
    assert completed_version(of_model(pushes, new), "rm") == 1
    assert completed_version(of_model(pushes[:1], new), "rm") is None
    # without an owner reference (kubectl): counted when made no earlier than the object
    assert belongs_to(_completed(2, None, "2026-11-27T00:00:05Z"), new)
    assert not belongs_to(_completed(2, None, "2026-11-26T12:00:00Z"), new)
    assert belongs_to(_completed(2, None, "2026-11-26T12:00:00Z"), old)


def test_the_status_written_for_an_earlier_object_is_not_read_for_a_new_one() -> None:
    written = {"metadata": {"uid": "old", "resourceVersion": "90"}, "status": {"weightsVersion": 3}}
    indexed = {"metadata": {"uid": "new", "resourceVersion": "80"}}
    assert freshest(indexed, written) is indexed
    same = {"metadata": {"uid": "old", "resourceVersion": "80"}}
    assert freshest(same, written) is written


def test_the_wipe_pod_removes_only_the_deleted_objects_directory_on_its_node() -> None:
    body = cpu_rm(weightSync={"persistDir": "/var/lib/rp-weights"})
    pod = wipe_pod(body, "cpu-a", "img:1", "/var/lib/rp-weights")
    [container] = pod["spec"]["containers"]
    assert pod["spec"]["nodeName"] == "cpu-a" and pod["spec"]["restartPolicy"] == "Never"
    assert container["command"][-1] == f"{WIPE_MOUNT}/uid-rm"  # <persistDir>/<uid>, nothing above it
    assert pod["spec"]["volumes"][0]["hostPath"]["path"] == "/var/lib/rp-weights"
    assert "rewardplane.io/model" not in pod["metadata"]["labels"]  # never taken for a replica
    assert wipe_pod_name("rm", "uid-rm", "cpu-a") != wipe_pod_name("rm", "uid-rm", "cpu-b")
    assert wipe_finished(None) and not wipe_finished({"status": {"phase": "Running"}})


def test_the_heartbeat_is_refreshed_once_per_interval_and_read_as_stale_after_missed_ones() -> None:
    first = heartbeat.confirmation({}, NOW, 30)
    assert first == {"confirmedAt": "2026-12-01T12:00:00Z", "confirmIntervalSeconds": 30}
    # younger than the interval: the same value, so an unchanged status costs no write
    assert heartbeat.confirmation(first, NOW + timedelta(seconds=20), 30) == first
    later = heartbeat.confirmation(first, NOW + timedelta(seconds=31), 30)
    assert later["confirmedAt"] == "2026-12-01T12:00:31Z"
    assert heartbeat.unconfirmed(first, NOW + timedelta(seconds=100)) is None
    doubt = heartbeat.unconfirmed(first, NOW + timedelta(seconds=600))
    assert doubt is not None and "600 s" in doubt and "operator running" in doubt
    assert "missing" in (heartbeat.unconfirmed({}, NOW) or "")


def test_a_second_push_is_refused_naming_the_one_in_progress() -> None:
    mine = {"metadata": {"name": "ux-b"}, "spec": {"rewardModelRef": "rc", "version": 9}}
    other = {"metadata": {"name": "rc"}, "spec": {"version": 9}, "status": {"phase": "Transferring"}}
    message = wsm.push_in_progress(mine, other)
    assert "WeightSync rc is pushing version 9 to RewardModel rc" in message
    assert "Transferring" in message and "one push per model" in message


def test_a_push_whose_trainer_never_joined_says_so() -> None:
    req = wsm.parse_push(
        {
            "metadata": {"name": "ux-b", "namespace": "ns", "generation": 1},
            "spec": {
                "rewardModelRef": "rc",
                "version": 9,
                "rendezvous": {"address": "10.0.0.9", "port": 29500},
                "manifestRef": {"configMapName": "m"},
                "timeoutSeconds": 60,
            },
        },
        {},
    )
    message = wsm.trainer_absent(req)
    assert "no trainer joined" in message and "10.0.0.9:29500" in message and "60 s" in message


def test_a_missing_path_is_named_not_the_kubelets_generic_timeout() -> None:
    generic = (
        "Unable to attach or mount volumes: unmounted volumes=[model]: timed out waiting for the condition"
    )
    specific = (
        'MountVolume.SetUp failed for volume "model" : hostPath type check failed: /data/m is not a directory'
    )
    events = [
        {"message": specific, "lastTimestamp": "2026-12-01T12:00:01Z"},
        {"message": generic, "lastTimestamp": "2026-12-01T12:00:05Z"},
    ]
    assert mount_problem(events) == specific
    assert mount_problem(events[1:]) == generic
    assert mount_problem([]) is None


def _unreadable_pod() -> dict[str, Any]:
    message = (
        "Traceback ...\nmodel files unreadable: /mnt/models/tiny/config.json (mode -rw------- (600), owner "
        "uid 0 gid 0) cannot be read by this server (uid 65532, gid 65532); make the checkpoint readable "
        "to it: chmod -R a+rX /mnt/models/tiny (save_pretrained as root under umask 077 writes 0600 files)"
    )
    pod = _pod(
        "rm-0",
        0,
        ready=False,
        containerStatuses=[
            {
                "restartCount": 1,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 2, "message": message}},
            }
        ],
    )
    pod["spec"]["containers"] = [{"volumeMounts": [{"name": "model", "mountPath": "/mnt/models"}]}]
    pod["spec"]["volumes"] = [{"name": "model", "hostPath": {"path": "/srv/models"}}]
    return pod


def test_model_unreadable_names_the_nodes_path_and_starts_at_its_first_word() -> None:
    status = _status(cpu_rm(), [_unreadable_pod()], {})
    degraded = _cond(status, "Degraded")
    assert degraded["reason"] == "ModelUnreadable"
    assert degraded["message"].startswith("rm-0: model files unreadable: /srv/models/tiny/config.json")
    assert "chmod -R a+rX /srv/models/tiny" in degraded["message"]
    assert "/mnt/models" not in degraded["message"]
    claim = {"spec": {"containers": [{"volumeMounts": [{"name": "m", "mountPath": "/mnt/models"}]}]}}
    claim["spec"]["volumes"] = [{"name": "m", "persistentVolumeClaim": {"claimName": "models"}}]
    assert "PersistentVolumeClaim models" in node_paths(claim, "/mnt/models/x unreadable")


def test_a_broken_model_does_not_say_its_rollout_is_complete() -> None:
    status = _status(cpu_rm(), [_unreadable_pod()], {})
    progressing = _cond(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "ReplicasBroken")
    assert "0/1" in progressing["message"] and "rm-0" in progressing["message"]


def test_weights_lost_with_persist_dir_does_not_ask_to_set_it() -> None:
    body = cpu_rm(weightSync={"persistDir": "/var/lib/rp-weights"})
    status = _status(
        body, [_pod("rm-0", 0)], {"rm-0": ProbeResult(0, "serving")}, target_version=3, lost_pods={"rm-0"}
    )
    message = _cond(status, "Degraded")["message"]
    assert status["reason"] == "WeightsLost" and "set spec.weightSync.persistDir" not in message
    assert "persistDir on node cpu-a" in message
    [event] = [e for e in transition_events({}, status) if e.reason == "WeightsLost"]
    assert "push version 3 again" in event.message
