"""Pure WeightSync and restart-recovery decisions (no sockets)."""

from __future__ import annotations

import pytest

from rewardplane.api import weightsync as wsapi
from rewardplane.operator import weightsync as wsm
from rewardplane.operator.conditions import compute_status
from rewardplane.operator.recovery import stale_replicas
from rewardplane.operator.status import ProbeResult
from rewardplane.protocol import ParamMeta, check_metadata
from rewardplane.protocol import RewardModelTrainingMode as Mode


def ws_body(**spec):
    base = {
        "rewardModelRef": "rm",
        "version": 3,
        "rendezvous": {"address": "10.0.0.1", "port": 4000},
        "manifestRef": {"configMapName": "rm-manifest", "sha256": "x"},
    }
    base.update(spec)
    return {"metadata": {"name": "rm", "namespace": "ns", "generation": 7}, "spec": base}


def test_parse_push_applies_the_models_defaults():
    req = wsm.parse_push(
        ws_body(), {"weightSync": {"defaultTrainingMode": "head_only", "timeoutSeconds": 42}}
    )
    assert (req.version, req.training_mode, req.timeout_s, req.port) == (3, Mode.HEAD_ONLY, 42.0, 4000)
    assert req.group_id == "rm-g7" and req.manifest_key == "manifest.json"
    assert wsm.parse_push(ws_body(trainingMode="full", timeoutSeconds=5), {}).timeout_s == 5


def test_parse_push_names_every_problem():
    with pytest.raises(wsm.WeightSyncRefused) as info:
        wsm.parse_push(ws_body(version=0, rendezvous={}, manifestRef={}, trainingMode="half"), {})
    msg = str(info.value)
    assert info.value.reason == "InvalidSpec"
    assert all(s in msg for s in ("spec.version", "spec.rendezvous", "configMapName", "'half'"))


def test_adapter_push_carries_its_lora_config_and_needs_lora_on_the_model():
    from rewardplane.protocol import AdapterConfig

    lora_on = {"lora": {"enabled": True, "maxRank": 16}}
    spec = wsapi.adapter_spec(AdapterConfig(rank=8, alpha=16.0))
    req = wsm.parse_push(ws_body(trainingMode="adapter", adapter=spec), lora_on)
    assert (req.training_mode, req.adapter) == (Mode.ADAPTER, AdapterConfig(rank=8, alpha=16.0))
    with pytest.raises(wsm.WeightSyncRefused, match=r"spec\.lora\.enabled: true"):
        wsm.parse_push(ws_body(trainingMode="adapter", adapter=spec), {})
    with pytest.raises(wsm.WeightSyncRefused, match=r"spec\.adapter \{rank, alpha\} is required"):
        wsm.parse_push(ws_body(trainingMode="adapter"), lora_on)
    with pytest.raises(wsm.WeightSyncRefused, match=r"spec\.adapter\.rank"):
        wsm.parse_push(ws_body(trainingMode="adapter", adapter={"rank": 0, "alpha": 1}), lora_on)
    with pytest.raises(wsm.WeightSyncRefused, match="goes with trainingMode adapter only"):
        wsm.parse_push(ws_body(trainingMode="full", adapter=spec), lora_on)


def test_a_delta_push_names_its_base_older_than_its_version_in_full_mode():
    assert wsm.parse_push(ws_body(baseVersion=2), {}).base_version == 2
    assert wsm.parse_push(ws_body(), {}).base_version is None
    for spec, needle in (
        ({"baseVersion": 3}, "must be older than spec.version 3"),
        ({"baseVersion": -1}, "integer >= 0"),
        ({"baseVersion": "2"}, "integer >= 0"),
        ({"baseVersion": 2, "trainingMode": "head_only"}, "trainingMode full only, not head_only"),
    ):
        with pytest.raises(wsm.WeightSyncRefused, match=needle) as info:
            wsm.parse_push(ws_body(**spec), {})
        assert info.value.reason == wsapi.INVALID_SPEC


def test_stale_and_duplicate_versions_are_refused():
    wsm.check_version(4, 3)
    for v in (3, 2):
        with pytest.raises(wsm.WeightSyncRefused) as info:
            wsm.check_version(v, 3)
        assert info.value.reason == "StaleVersion" and "push version 4 or higher" in str(info.value)


def test_current_version_counts_completed_pushes_and_history():
    rm = {"metadata": {"name": "rm"}, "status": {"weightsVersion": 2}}
    pushes = [
        {
            "spec": {"rewardModelRef": "rm"},
            "status": {"phase": "Failed", "version": 9, "history": [{"version": 5, "phase": "Completed"}]},
        },
        {"spec": {"rewardModelRef": "other"}, "status": {"phase": "Completed", "version": 11}},
    ]
    assert wsm.completed_version(pushes, "rm") == 5
    assert wsm.current_version(rm, pushes) == 5
    assert wsm.current_version(rm, []) == 2


def test_group_ranks_follow_replica_order_and_world_sizes():
    cands = [
        wsm.Candidate(1, "rm-1", "u1", 2, 3, "serving"),
        wsm.Candidate(0, "rm-0", "u0", 1, 3, "serving"),
        wsm.Candidate(2, "rm-2", "u2", 2, 3, "broken"),
    ]
    plan = wsm.plan_group(cands, 3, Mode.HEAD_ONLY)
    assert [(t.pod, t.rank_offset) for t in plan.targets] == [("rm-0", 0), ("rm-1", 1), ("rm-2", 3)]
    assert plan.world_size == 6


def test_a_multi_rank_trainer_takes_the_last_ranks():
    req = wsm.parse_push(ws_body(trainer={"ranks": 4, "interface": "eth0"}), {})
    assert req.senders == 4 and wsm.parse_push(ws_body(), {}).senders == 1
    cands = [wsm.Candidate(0, "rm-0", "u0", 2, 3, "serving"), wsm.Candidate(1, "rm-1", "u1", 1, 3, "serving")]
    plan = wsm.plan_group(cands, 3, Mode.FULL, senders=4)
    assert [t.rank_offset for t in plan.targets] == [0, 2] and plan.world_size == 7  # trainer: ranks 3-6
    with pytest.raises(wsm.WeightSyncRefused, match=r"spec\.trainer\.ranks must be an integer >= 1"):
        wsm.parse_push(ws_body(trainer={"ranks": 0}), {})


def test_replicas_behind_join_only_full_pushes():
    cands = [wsm.Candidate(0, "rm-0", "u0", 1, 3, "serving"), wsm.Candidate(1, "rm-1", "u1", 1, 0, "serving")]
    head = wsm.plan_group(cands, 3, Mode.HEAD_ONLY)
    assert [t.pod for t in head.targets] == ["rm-0"] and head.world_size == 2 and "rm-1" in head.skipped[0]
    assert [t.pod for t in wsm.plan_group(cands, 3, Mode.FULL).targets] == ["rm-0", "rm-1"]
    with pytest.raises(wsm.WeightSyncRefused) as info:
        wsm.plan_group([], 0, Mode.FULL)
    assert info.value.reason == "NoReadyReplicas"


def test_replica_outcome():
    assert wsm.replica_outcome(3, {"version": 3, "state": "serving"}, None) == ("Completed", None)
    assert wsm.replica_outcome(3, {"version": 2, "state": "updating"}, {"num_background_tasks": 1}) == (
        None,
        None,
    )
    assert wsm.replica_outcome(
        3, {"version": 2, "state": "broken"}, {"num_background_tasks": 0, "last_error": "peer died"}
    ) == ("Failed", "peer died")
    assert wsm.replica_outcome(3, None, None) == (None, None)


def test_manifest_round_trip_checks_the_hash_and_compresses_large_ones():
    metas = [ParamMeta(name=f"model.layers.{i}.weight", dtype="float32", shape=(4, 4)) for i in range(50)]
    data, key, sha = wsapi.encode_manifest(metas)
    assert key == "manifest.json"
    assert wsapi.decode_manifest({"data": data}, key, sha) == metas
    with pytest.raises(wsm.WeightSyncRefused) as info:
        wsapi.decode_manifest({"data": data}, key, "0" * 64)
    assert info.value.reason == "ManifestInvalid"
    data, key, sha = wsapi.encode_manifest(metas, compress_over=100)
    assert key == "manifest.json.gz"
    assert wsapi.decode_manifest({"binaryData": data}, key, sha) == metas


def test_history_is_bounded_and_finish_clears_nothing_it_should_keep():
    history = [{"version": i, "phase": "Completed"} for i in range(10)]
    previous = {"version": 11, "trainingMode": "full", "worldSize": 3, "history": history}
    patch = wsm.finish_status(
        previous, "Failed", "2026-01-01T00:00:00Z", 1.5, reason="Timeout", message="slow"
    )
    assert len(patch["history"]) == 10 and patch["history"][-1]["version"] == 11
    assert patch["history"][-1]["reason"] == "Timeout" and patch["history"][0]["version"] == 1
    start = wsm.start_status(wsm.parse_push(ws_body(), {}), "t")
    assert start["reason"] is None and start["phase"] == "Pending" and start["observedGeneration"] == 7


def _pod(name, uid, restarts=0):
    return {
        "metadata": {"name": name, "uid": uid, "labels": {"rewardplane.io/replica": name[-1]}},
        "status": {"containerStatuses": [{"restartCount": restarts}]},
    }


def test_only_restarted_replicas_behind_the_model_are_stale():
    pods = [_pod("rm-0", "a"), _pod("rm-1", "b")]
    probes = {"rm-0": ProbeResult(3, "serving"), "rm-1": ProbeResult(3, "serving")}
    stale, seen = stale_replicas(pods, probes, 3, {})
    assert stale == set() and seen == {"rm-0": ("a", 0), "rm-1": ("b", 0)}
    # Lagging during a push (same identity): not stale.
    lag = {**probes, "rm-1": ProbeResult(2, "updating")}
    assert stale_replicas(pods, lag, 3, seen)[0] == set()
    # Restarted (restart count up) and back on base weights: stale; a new UID too.
    restarted = [_pod("rm-0", "a"), _pod("rm-1", "b", restarts=1)]
    assert stale_replicas(restarted, {**probes, "rm-1": ProbeResult(0, "serving")}, 3, seen)[0] == {"rm-1"}
    replaced = [_pod("rm-0", "a"), _pod("rm-1", "c")]
    assert stale_replicas(replaced, {**probes, "rm-1": ProbeResult(0, "serving")}, 3, seen)[0] == {"rm-1"}
    # Broken after a failed push: left for the next push, not restored.
    assert stale_replicas(restarted, {**probes, "rm-1": ProbeResult(2, "broken")}, 3, seen)[0] == set()


def test_stale_endpoints_are_never_ready():
    body = {"metadata": {"name": "rm", "namespace": "d", "generation": 1}, "spec": {"replicas": 1}}
    pod = {
        "metadata": {"name": "rm-0", "uid": "u", "labels": {"rewardplane.io/replica": "0"}},
        "status": {"podIP": "127.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    status = compute_status(
        body, None, [pod], {"rm-0": ProbeResult(0, "serving")}, "t", target_version=3, stale_pods={"rm-0"}
    )
    (ep,) = status["endpoints"]
    assert (
        ep["state"] == "stale" and not ep["ready"] and ep["podUid"] == "u" and status["weightsVersion"] == 3
    )


def test_sdk_checks_names_shapes_and_dtypes_before_sending():
    served = {
        "score.weight": ParamMeta(name="score.weight", dtype="float32", shape=(1, 8)),
        "ids": ParamMeta(name="ids", dtype="int64", shape=(3,)),
    }
    sent = [
        ParamMeta(name="score.weight", dtype="bfloat16", shape=(1, 8)),
        ParamMeta(name="ids", dtype="float32", shape=(3,)),
        ParamMeta(name="nope", dtype="float32", shape=(1,)),
    ]
    problems = check_metadata(sent, served)
    assert len(problems) == 2 and "dtype float32" in problems[0] and "unknown parameter 'nope'" in problems[1]


def test_a_resumed_push_measures_its_duration_from_its_recorded_start():
    from datetime import datetime, timezone

    now = datetime(2026, 11, 26, 12, 0, 30, tzinfo=timezone.utc)
    assert wsm.seconds_since("2026-11-26T12:00:00Z", now) == 30.0
    assert wsm.seconds_since(None, now) == 0.0
    assert wsm.seconds_since("not a time", now) == 0.0
    assert wsm.seconds_since("2026-11-26T12:01:00Z", now) == 0.0  # clocks skewed: never negative


def test_a_push_asks_for_a_slicing_agreement_only_where_every_replica_takes_part():
    assert wsm.parse_push(ws_body(trainer={"agreeSlicing": True}), {}).agree_slicing is True
    assert wsm.parse_push(ws_body(), {}).agree_slicing is False
    with pytest.raises(wsm.WeightSyncRefused, match=r"spec\.trainer\.agreeSlicing must be true or false"):
        wsm.parse_push(ws_body(trainer={"agreeSlicing": "yes"}), {})
    new = [wsm.Candidate(i, f"rm-{i}", f"u{i}", 2, 3, "serving", agrees_slicing=True) for i in range(2)]
    assert wsm.plan_group(new, 3, Mode.FULL).agrees_slicing
    # a server without the agreement (an older image) would never join the reduction
    old = [new[0], wsm.Candidate(1, "rm-1", "u1", 2, 3, "serving")]
    assert not wsm.plan_group(old, 3, Mode.FULL).agrees_slicing
    assert "agreeSlicing" in wsm.start_status(wsm.parse_push(ws_body(), {}), "now")  # cleared per push
