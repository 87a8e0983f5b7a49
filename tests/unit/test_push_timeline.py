"""A push's phases from a replica's timeline (``protocol.push_phases``, shared by the server's
``rewardplane:weight_push_phase_seconds`` and the SDK's picture), and ``rewardplane push
--timeline``'s PNG: a valid image with one row per replica the push reached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rewardplane.protocol.push_phases import phase_spans
from rewardplane.sdk.cli import build_parser
from rewardplane.sdk.timeline import TimelineUnavailable, replica_timelines, write_png

# after_announce_ms of a streamed push (lock first, then the bytes) and of an atomic one (bytes
# staged first, the lock only for the swap), as the server's last_update reports them
STREAMED = {"task": 0.2, "locked": 3.0, "worker_in": 3.5, "returned": 40.0, "committed": 41.5}
ATOMIC = {"task": 0.1, "worker_in": 0.5, "returned": 30.0, "locked": 32.0, "committed": 35.0}


def test_a_streamed_push_waits_for_the_lock_before_its_bytes() -> None:
    assert phase_spans(STREAMED) == {
        "queue": (0.0, 0.2),
        "wait_lock": (0.2, 3.0),
        "receive": (3.5, 40.0),
        "commit": (40.0, 41.5),
    }


def test_an_atomic_push_takes_the_lock_only_for_the_swap() -> None:
    assert phase_spans(ATOMIC) == {
        "queue": (0.0, 0.1),
        "wait_lock": (30.0, 32.0),
        "receive": (0.5, 30.0),
        "commit": (32.0, 35.0),
    }


def test_a_push_that_failed_mid_receive_has_no_commit() -> None:
    assert set(phase_spans({"task": 0.1, "locked": 1.0, "returned": 9.0})) == {
        "queue",
        "wait_lock",
        "receive",
    }


def _answers(version: int) -> dict[str, dict[str, Any]]:
    return {
        f"http://10.0.0.{i}:8000/get_num_background_tasks": {
            "num_background_tasks": 0,
            "last_update": {"version": version, "after_announce_ms": STREAMED if i % 2 else ATOMIC},
        }
        for i in range(3)
    }


REPLICAS = [{"pod": f"rm-{i}", "url": f"http://10.0.0.{i}:8000"} for i in (2, 0, 1)]


def test_the_png_is_written_with_a_row_per_replica(tmp_path: Path) -> None:
    from PIL import Image

    timelines = replica_timelines(REPLICAS, 7, _answers(7).__getitem__)
    assert [t.replica for t in timelines] == ["rm-0", "rm-1", "rm-2"]
    assert timelines[1].spans == phase_spans(STREAMED)
    out = tmp_path / "push.png"
    write_png(out, timelines, "rm: push of version 7 (full)")
    with Image.open(out) as img:
        img.verify()  # a whole, valid PNG
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width >= 600 and img.height >= 150
        assert img.info["Description"] == "replicas: rm-0, rm-1, rm-2"


def test_a_replica_past_the_push_is_named(tmp_path: Path) -> None:
    with pytest.raises(TimelineUnavailable, match="rm-0 last loaded version 8, not 7"):
        replica_timelines(REPLICAS, 7, _answers(8).__getitem__)


def test_push_takes_a_timeline_path() -> None:
    args = build_parser().parse_args(
        ["push", "rm", "--from", "ckpt", "--version", "3", "--timeline", "t.png"]
    )
    assert args.timeline == Path("t.png")
