"""The phases of one weight push on one reward server, from the timeline it reports
(``last_update.after_announce_ms`` of ``/get_num_background_tasks``: event → ms after the announce
reached the server). One definition for the server's ``rewardplane:weight_push_phase_seconds``
metric and the SDK's per-replica timeline picture.

- ``queue``: the announce (or a data-plane header) arrived → the update task started.
- ``wait_lock``: waiting for the exclusive weights lock (scoring in flight drains). A streamed
  push takes it before its bytes arrive; an atomic push after, for the swap only.
- ``receive``: the workers receive the bytes (streamed: load them; atomic: stage them).
- ``commit``: the bytes are in and the lock held → the new version serves (an atomic push's apply
  of its staged copy, the cache reset, the commit).
"""

from __future__ import annotations

from collections.abc import Mapping

PHASES = ("queue", "wait_lock", "receive", "commit")


def phase_spans(after_announce_ms: Mapping[str, float]) -> dict[str, tuple[float, float]]:
    """Each phase the timeline shows, as (start, end) in ms after the announce. A phase whose
    stamps are missing (a push that failed before it) is left out."""
    t = after_announce_ms
    spans: dict[str, tuple[float, float]] = {}
    if "task" in t:
        spans["queue"] = (0.0, t["task"])
    returned, locked = t.get("returned"), t.get("locked")
    if returned is not None:
        start = t.get(
            "worker_in", locked if locked is not None and locked <= returned else t.get("task", 0.0)
        )
        spans["receive"] = (start, returned)
    if locked is not None:
        streamed = returned is None or locked <= returned
        spans["wait_lock"] = (t.get("task", 0.0), locked) if streamed else (returned or 0.0, locked)
    if "committed" in t and returned is not None:
        start = max(returned, locked if locked is not None else returned)
        spans["commit"] = (start, t["committed"])
    return {p: spans[p] for p in PHASES if p in spans and spans[p][1] >= spans[p][0]}
