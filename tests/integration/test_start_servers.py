"""``rewardplane.testing.servers.start_servers``: servers started side by side are each healthy, and
when one cannot start, none is left running."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from rewardplane.testing.servers import free_port, start_servers


def _listening(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.TransportError:
        return False
    return True


def test_servers_started_side_by_side_each_answer(tiny_model_dir: Path, tmp_path: Path) -> None:
    handles = start_servers(tiny_model_dir, tmp_path, {}, {"max_items_per_request": 4})
    try:
        for h in handles:
            assert httpx.get(f"{h.url}/health", timeout=5).status_code == 200
        assert len({h.port for h in handles}) == 2
    finally:
        for h in handles:
            h.stop()


def test_one_that_cannot_start_stops_the_others(tiny_model_dir: Path, tmp_path: Path) -> None:
    good, bad = free_port(), free_port()
    with pytest.raises(RuntimeError, match="exited"):
        # the second cannot start: the server refuses a flag it does not know
        start_servers(
            tiny_model_dir, tmp_path, {"port": good}, {"port": bad, "extra_args": ["--no-such-flag"]}
        )
    assert not _listening(good) and not _listening(bad)
