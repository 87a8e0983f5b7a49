"""The atomic-push staging check (``server/staging.py``): refused with the reason and the way out
when the staged copy cannot fit, counting the allocator's unused cache as room."""

from __future__ import annotations

import pytest

from rewardplane.server.weight_sync.staging import (
    GIB,
    STAGING_MARGIN_BYTES,
    staging_limit_from_env,
    staging_problem,
)


def test_a_push_that_fits_is_not_refused() -> None:
    assert staging_problem(13 * GIB, where="GPU 0", free=20 * GIB) is None


def test_a_push_that_does_not_fit_names_sizes_and_ways_out() -> None:
    problem = staging_problem(13 * GIB, where="GPU 3", free=9 * GIB)
    assert problem is not None
    assert "13.00 GiB" in problem and "GPU 3" in problem and "9.00 GiB are free" in problem
    assert "atomic=False" in problem and "memoryFraction" in problem


def test_the_allocators_unused_cache_counts_as_room() -> None:
    # a second atomic push reuses the first one's cached buffers: not refused for them
    assert staging_problem(13 * GIB, where="GPU 0", free=1 * GIB, cached=13 * GIB) is None
    assert staging_problem(13 * GIB, where="GPU 0", free=13 * GIB + STAGING_MARGIN_BYTES - 1) is not None


def test_off_a_gpu_only_the_operators_limit_applies() -> None:
    assert staging_problem(100 * GIB, where="host memory", free=None) is None
    problem = staging_problem(2 * GIB, where="host memory", free=None, limit=GIB)
    assert problem is not None and "REWARDPLANE_STAGING_MAX_BYTES" in problem


def test_the_limit_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REWARDPLANE_STAGING_MAX_BYTES", raising=False)
    assert staging_limit_from_env() is None
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "1048576")
    assert staging_limit_from_env() == 1 << 20
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "1G")
    with pytest.raises(ValueError, match="whole number of bytes"):
        staging_limit_from_env()
