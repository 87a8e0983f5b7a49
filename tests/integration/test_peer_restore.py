"""Peer restore: a replica on the current weights sends them to a fresh one over the data plane (gloo).

Real server processes; the operator's own restore_from_peer drives them, as the reconciler does.
"""

from __future__ import annotations

import time

import httpx
import pytest

from rewardplane.operator.replicas import HttpReplicas, ReplicaError
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.testing.pushers import loopback_peer_restore
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import logits, perturbed
from tests.integration.test_weight_sync import TOKEN, close, served, sync_for


def _wait_version(url: str, version: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    got = -1
    while time.monotonic() < deadline:
        got = int(httpx.get(f"{url}/runtime_version", timeout=5).json()["version"])
        if got >= version:
            return got
        time.sleep(0.1)
    return got


def test_fresh_replica_gets_the_current_weights_from_a_peer(server_factory, tiny_model_dir) -> None:
    source, fresh = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    trained = perturbed(tiny_model_dir, seed=21)
    with sync_for(source, bucket_bytes=1 << 16) as sync:
        sync.push(trained.state_dict(), version=3, training_mode=Mode.FULL)
    want = logits(trained, tiny_model_dir, TEXTS)
    assert served(fresh)[1] == 0 and not close(served(fresh)[0], want)

    replicas = HttpReplicas()

    def restore(version: int, timeout_s: float, group_id: str) -> None:
        loopback_peer_restore(
            replicas, TOKEN, source.url, fresh.url, version=version, timeout_s=timeout_s, group_id=group_id
        )

    try:
        restore(3, 60, "peer-test")
        assert _wait_version(fresh.url, 3) == 3, (
            f"--- source log\n{source.log()[-3000:]}\n--- fresh log\n{fresh.log()[-3000:]}"
        )
        got, version = served(fresh)
        assert version == 3 and close(got, want)
        # The source kept serving the same weights while and after it sent them.
        assert served(source)[1] == 3 and close(served(source)[0], want)

        # A source that does not serve the asked version refuses before anything moves.
        with pytest.raises(ReplicaError, match="serves version 3") as refused:
            restore(4, 10, "peer-test-2")
        assert "409" in str(refused.value)
    finally:
        replicas.close()
