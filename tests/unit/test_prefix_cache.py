"""How a weight change invalidates vLLM's prefix cache (``REWARDPLANE_PREFIX_CACHE``): by default
requests are salted with the weights' cache epoch, which every change advances; ``reset`` asks the
engine for its engine-wide reset instead. Bad values name the choices."""

from __future__ import annotations

import pytest

from rewardplane.server.engines.prefix_cache import CacheEpoch, invalidation_from_env


@pytest.mark.parametrize("raw,choice", [(None, "salt"), ("salt", "salt"), (" RESET ", "reset")])
def test_the_choices(monkeypatch: pytest.MonkeyPatch, raw: str | None, choice: str) -> None:
    if raw is None:
        monkeypatch.delenv("REWARDPLANE_PREFIX_CACHE", raising=False)
    else:
        monkeypatch.setenv("REWARDPLANE_PREFIX_CACHE", raw)
    assert invalidation_from_env() == choice


def test_anything_else_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWARDPLANE_PREFIX_CACHE", "off")
    with pytest.raises(ValueError, match="give one of salt, reset .default salt. — salt: "):
        invalidation_from_env()


def test_every_weight_change_gives_requests_a_salt_never_used_before() -> None:
    epoch = CacheEpoch("salt")
    seen = {epoch.salt()}
    for _ in range(3):
        assert epoch.weights_changed() is False  # nothing for the engine to do
        salt = epoch.salt()
        assert salt is not None and salt not in seen
        seen.add(salt)
    assert epoch.salt() == epoch.salt()  # stable between changes: requests of one version share blocks


def test_without_salt_the_engine_resets_its_cache() -> None:
    epoch = CacheEpoch("reset")
    assert epoch.salt() is None
    assert epoch.weights_changed() is True
    assert epoch.salt() is None
