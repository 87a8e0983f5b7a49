"""When a data-plane push sends the engine's cache reset (``REWARDPLANE_RESET_CACHE_AT``): the
three moments are accepted, anything else is refused with the choices named."""

from __future__ import annotations

import pytest

from rewardplane.server.weight_sync.data_push import _reset_moment_from_env


@pytest.mark.parametrize("raw,moment", [("", "go"), ("go", "go"), ("LOCK", "lock"), (" posted ", "posted")])
def test_the_moments(monkeypatch: pytest.MonkeyPatch, raw: str, moment: str) -> None:
    if raw:
        monkeypatch.setenv("REWARDPLANE_RESET_CACHE_AT", raw)
    else:
        monkeypatch.delenv("REWARDPLANE_RESET_CACHE_AT", raising=False)
    assert _reset_moment_from_env() == moment


def test_anything_else_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWARDPLANE_RESET_CACHE_AT", "after-go")
    with pytest.raises(ValueError, match="one of lock, go, posted"):
        _reset_moment_from_env()
