"""The SDK's public surface: one exception tree, the flat namespace, and the old names and import
paths that keep working (with a warning where a module moved)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import subprocess
import sys
import warnings

import pytest

import rewardplane.sdk as sdk
from rewardplane.sdk._compat import MOVED


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


def test_the_old_module_paths_of_the_errors_name_the_same_classes() -> None:
    from rewardplane.protocol.naming import WeightValidationError
    from rewardplane.sdk.cluster import ClusterError, WeightSyncFailed
    from rewardplane.sdk.retry import RewardClientError, RewardServerError, RewardServerUnavailable

    assert (RewardClientError, RewardServerError, RewardServerUnavailable) == (
        sdk.RewardClientError,
        sdk.RewardServerError,
        sdk.RewardServerUnavailable,
    )
    assert (ClusterError, WeightSyncFailed, WeightValidationError) == (
        sdk.ClusterError,
        sdk.WeightSyncFailed,
        sdk.WeightValidationError,
    )


def test_every_exported_name_resolves_and_the_import_needs_no_torch() -> None:
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None, name
    code = "import sys, rewardplane.sdk; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_push_classes_load_lazily_and_keep_their_old_names() -> None:
    from rewardplane.sdk.direct_sync import DirectWeightSync
    from rewardplane.sdk.publisher import WeightSyncError

    assert sdk.WeightPusher is DirectWeightSync and DirectWeightSync.sync is DirectWeightSync.push
    assert WeightSyncError is sdk.WeightSyncError
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        sdk.Nope  # noqa: B018


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_modules_keep_their_old_path_with_a_deprecation_warning(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_seed_names_and_precise_types() -> None:
    client = sdk.VLLMRewardClient(endpoints=["http://127.0.0.1:9"], check_server=False)
    assert isinstance(client, sdk.AsyncRewardClient) and isinstance(client, sdk.RewardModelClient)
    hints = inspect.get_annotations(sdk.VLLMRewardClient.sync_weights, eval_str=False)
    assert hints["return"] == "str"  # the seed's contract; WeightPusher.push returns the int
    assert inspect.signature(sdk.create_reward_publisher).return_annotation == (
        "RewardModelPublisher | Rank0OnlyPublisher"
    )
    client.close()
    with pytest.raises(sdk.ClientClosedError, match="VLLMRewardClient is closed"):
        client.score_batch_sync(["x"])
    with pytest.raises(RuntimeError):  # still a RuntimeError for code written before the tree
        asyncio.run(client.score_batch(["x"]))


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


def test_cluster_handle_reads_through_methods_and_the_old_properties_warn() -> None:
    from rewardplane.sdk.cluster import RewardModelHandle

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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert handle.weights_version == 3 and handle.status["phase"] == "Ready"
        assert [e.url for e in handle.endpoints] == handle.urls == handle.get_urls()
    assert len(caught) == 4 and all(issubclass(w.category, DeprecationWarning) for w in caught)
    assert "get_weights_version()" in str(caught[0].message)


def test_client_rides_out_a_readiness_blip_and_waits_when_nothing_is_ready() -> None:
    """A kubelet restart resets every Pod's readiness for a few seconds: client() keeps the client
    it handed out (whose replicas still serve) instead of raising; with no client yet it waits for
    a ready replica, bounded, and then names the model's state."""
    import time as clock

    from rewardplane.api.names import RM_PLURAL, custom_path
    from rewardplane.sdk.cluster import ClusterError, RewardModelHandle
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
    put(False)  # the blip
    assert handle.client() is client
    client.close()
