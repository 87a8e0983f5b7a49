"""How a weight change invalidates vLLM's prefix cache: requests are salted with the weights' cache
epoch, which every change advances (no engine-wide reset)."""

from __future__ import annotations

from rewardplane.server.engines.prefix_cache import CacheEpoch


def test_every_weight_change_gives_requests_a_salt_never_used_before() -> None:
    epoch = CacheEpoch()
    seen = {epoch.salt()}
    for _ in range(3):
        epoch.weights_changed()
        salt = epoch.salt()
        assert salt not in seen
        seen.add(salt)
    assert epoch.salt() == epoch.salt()  # stable between changes: requests of one version share blocks
