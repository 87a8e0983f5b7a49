"""The SDK's public surface: one exception tree, and a flat namespace that is exactly what
docs/sdk.md documents."""

from __future__ import annotations

import asyncio
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rewardplane.sdk as sdk

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"


def test_every_public_error_is_a_rewardplane_error_and_keeps_its_builtin_base() -> None:
    errors = [
        getattr(sdk, n) for n in sdk.__all__ if n.endswith(("Error", "Failed", "Unavailable", "Timeout"))
    ]
    assert len(errors) == 13
    assert all(issubclass(e, sdk.RewardplaneError) for e in errors)
    assert issubclass(sdk.WeightSyncFailed, sdk.WeightSyncError)  # no near-collision any more
    assert issubclass(sdk.RewardServerError, sdk.RewardClientError)
    assert issubclass(sdk.RewardServerUnavailable, ConnectionError)
    assert issubclass(sdk.WeightValidationError, ValueError)
    assert issubclass(sdk.CreditAssignmentError, ValueError)
    assert issubclass(sdk.JudgeParseError, ValueError)
    assert issubclass(sdk.ClusterError, RuntimeError) and issubclass(sdk.WeightSyncError, RuntimeError)
    assert issubclass(sdk.RewardplaneTimeout, TimeoutError)
    assert issubclass(sdk.ClientClosedError, RuntimeError)


def test_the_errors_of_the_shared_core_and_the_retry_module_are_the_sdks() -> None:
    from rewardplane.protocol.naming import WeightValidationError
    from rewardplane.sdk.retry import RewardClientError, RewardServerError, RewardServerUnavailable

    assert (RewardClientError, RewardServerError, RewardServerUnavailable) == (
        sdk.RewardClientError,
        sdk.RewardServerError,
        sdk.RewardServerUnavailable,
    )
    assert WeightValidationError is sdk.WeightValidationError


def test_all_is_what_the_docs_document() -> None:
    """``__all__`` is the "Public surface" table of docs/sdk.md, name for name (plus the errors of
    the tree drawn under "Errors"), and nothing else."""
    text = DOCS.read_text()
    table = text.split("## Public surface", 1)[1].split("\n## ", 1)[0]
    documented = {
        name
        for row in table.splitlines()
        if row.startswith("| ") and not row.startswith("| area")
        for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row.split("|")[2])
    }
    tree = text.split("## Errors", 1)[1].split("```", 2)[1]
    documented |= {m.group(1) for m in re.finditer(r"^[^A-Za-z\n]*([A-Za-z]+)", tree, re.MULTILINE)}
    assert set(sdk.__all__) == documented
    assert len(sdk.__all__) == len(set(sdk.__all__))


def test_every_exported_name_resolves_and_the_import_needs_no_torch() -> None:
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None, name
    code = "import sys, rewardplane.sdk; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_push_classes_load_lazily() -> None:
    from rewardplane.sdk.push.pusher import WeightPusher
    from rewardplane.sdk.push.wire.http import WeightSyncError

    assert sdk.WeightPusher is WeightPusher
    assert WeightSyncError is sdk.WeightSyncError
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        sdk.Nope  # noqa: B018


@pytest.mark.parametrize("gone", ["protocol", "naming", "auth", "buckets", "comm", "transfer"])
def test_the_alias_modules_are_gone(gone: str) -> None:
    """Modules that moved to the shared core have one home: ``rewardplane.protocol`` or
    ``rewardplane.transport``, not an alias under the SDK."""
    with pytest.raises(ModuleNotFoundError):
        __import__(f"rewardplane.sdk.{gone}")


def test_a_closed_client_raises_client_closed_error() -> None:
    client = sdk.RewardClient("http://127.0.0.1:9")
    client.close()
    with pytest.raises(sdk.ClientClosedError, match="RewardClient is closed"):
        client.score_batch(["x"])
    aclient = sdk.AsyncRewardClient("http://127.0.0.1:9")
    asyncio.run(aclient.aclose())
    with pytest.raises(sdk.ClientClosedError, match="AsyncRewardClient is closed"):
        asyncio.run(aclient.score_batch(["x"]))


def test_the_blocking_client_takes_the_async_clients_parameters() -> None:
    # Each client spells its methods' keywords out (help() and IDEs show them, defaults included);
    # this keeps the two copies alike.
    shared = [
        n
        for n in vars(sdk.AsyncRewardClient)
        if not n.startswith("_") and callable(getattr(sdk.RewardClient, n, None))
    ]
    assert {"chat", "score_batch", "score_chats", "sleep", "wake"} <= set(shared)
    for name in shared:
        async_sig = inspect.signature(getattr(sdk.AsyncRewardClient, name))
        sync_sig = inspect.signature(getattr(sdk.RewardClient, name))
        assert async_sig.parameters == sync_sig.parameters, name
        assert async_sig.return_annotation == sync_sig.return_annotation, name


def test_cluster_handle_reads_through_methods_only() -> None:
    from rewardplane.sdk import RewardModelHandle

    class FakeKube:  # stands in for the API server: returns one RewardModel object
        def get(self, path: str) -> dict[str, object]:
            return {
                "spec": {"replicas": 2},
                "status": {
                    "phase": "Ready",
                    "weightsVersion": 3,
                    "endpoints": [
                        {
                            "replica": 1,
                            "pod": "m-1",
                            "url": "http://b:8001",
                            "ready": True,
                            "weightsVersion": 3,
                        },
                        {
                            "replica": 0,
                            "pod": "m-0",
                            "url": "http://a:8001",
                            "ready": True,
                            "weightsVersion": 3,
                        },
                        {"replica": 2, "pod": "m-2", "url": "http://c:8001", "ready": False},
                    ],
                },
            }

        def close(self) -> None:
            pass

    handle = RewardModelHandle("m", kube=FakeKube())  # type: ignore[arg-type]
    status = handle.get_status()
    assert status.phase == "Ready" and status.weights_version == 3 and len(status.endpoints) == 3
    assert handle.get_urls() == ["http://a:8001", "http://b:8001"]  # ready ones, in replica order
    assert handle.get_weights_version() == 3
    assert handle.wait_ready(1).phase == "Ready"  # 2 of 2 desired replicas ready
    assert [e.url for e in handle.get_endpoints()] == handle.get_urls()
    # no attribute reads the cluster: the earlier properties are gone
    for gone in ("status", "weights_version", "endpoints", "urls", "all_endpoints"):
        assert not hasattr(handle, gone), gone


def test_client_rides_out_a_readiness_blip_and_waits_when_nothing_is_ready() -> None:
    """A kubelet restart resets every Pod's readiness for a few seconds: client() keeps the client
    it handed out (whose replicas still serve) instead of raising; with no client yet it waits for
    a ready replica, bounded, and then names the model's state."""
    import time as clock

    from rewardplane.api.names import RM_PLURAL, custom_path
    from rewardplane.sdk import ClusterError, RewardClient, RewardModelHandle
    from rewardplane.testing.kube import MemoryKube

    kube = MemoryKube()
    path = custom_path("default", plural=RM_PLURAL)

    def put(ready: bool) -> None:
        kube.put(
            path,
            {
                "metadata": {"name": "m", "namespace": "default"},
                "spec": {"replicas": 1},
                "status": {
                    "phase": "Ready" if ready else "Pending",
                    "message": "waiting for m-0 to become ready",
                    "endpoints": [{"replica": 0, "pod": "m-0", "url": "http://a:8001", "ready": ready}],
                },
            },
        )

    put(False)
    handle = RewardModelHandle("m", kube=kube)  # type: ignore[arg-type]
    started = clock.monotonic()
    with pytest.raises(ClusterError, match="no ready replica after 1s.*waiting for m-0"):
        handle.client(wait_s=1.0)
    assert clock.monotonic() - started >= 1.0
    put(True)
    client = handle.client()
    assert isinstance(client, RewardClient) and client.endpoints == ["http://a:8001"]  # the main client
    put(False)  # the blip
    assert handle.client() is client
    client.close()


def test_a_failed_push_holds_nothing_of_its_group_while_its_exception_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer that pushes again inside its ``except`` block keeps the failed push's exception,
    and with it the push's frames, alive: they must not hold the rendezvous store and process group
    (replicas that accepted the update would wait for a trainer that looks alive)."""
    import gc
    import weakref

    from rewardplane.sdk import RewardModelTrainingMode
    from rewardplane.sdk._exceptions import WeightSyncFailed
    from rewardplane.sdk.cluster import RewardModelHandle
    from rewardplane.sdk.push.wire.operator import OperatorPush

    class Group:  # stands for the store and the process group a push opens
        pass

    opened: list[weakref.ref[Group]] = []

    def failing_push(self: OperatorPush, *args: object, **kwargs: object) -> None:
        group = Group()
        opened.append(weakref.ref(group))
        raise WeightSyncFailed("the operator restarted", "OperatorRestarted")

    monkeypatch.setattr(OperatorPush, "push", failing_push)
    monkeypatch.setattr(RewardModelHandle, "prepare", lambda self, *a, **k: ([], {}))
    handle = RewardModelHandle("m", kube=object())  # type: ignore[arg-type]
    gc.disable()  # the frames must be freed by reference counting, at once
    try:
        with pytest.raises(WeightSyncFailed) as failed:
            handle.push_weights({}, 1, RewardModelTrainingMode.FULL)
        assert failed.value.reason == "OperatorRestarted"
        assert opened and opened[0]() is None
    finally:
        gc.enable()


def test_every_scoring_entry_point_returns_raw_scores_by_default() -> None:
    """One rule for ``normalize`` (docs/sdk.md): raw head outputs unless asked, as RL uses them."""
    from rewardplane.sdk import integrations
    from rewardplane.sdk._scorer import AsyncScoringClient

    entry_points = [
        sdk.RewardClient.score_batch,
        sdk.RewardClient.score_chats,
        sdk.AsyncRewardClient.score_batch,
        sdk.AsyncRewardClient.score_chats,
        sdk.GenerativeJudge.score_batch,
        AsyncScoringClient.score_batch,
        sdk.RewardModelScorer.__init__,
        sdk.RewardLoop.add_reward_model,
        sdk.make_reward_rl,
        integrations.TRLRewardFunction.__init__,
        integrations.verl_compute_score,
    ]
    defaults = {f.__qualname__: inspect.signature(f).parameters["normalize"].default for f in entry_points}
    assert defaults == dict.fromkeys(defaults, False)
