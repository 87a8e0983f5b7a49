"""The worker extension's layout cache, which lets the control plane send a push's metadata to the
workers once: a layout named by id alone that the worker does not hold is refused before any
receive is posted (the control plane then sends the metadata), and eviction is first in, first out
(the control plane mirrors it)."""

from __future__ import annotations

import torch

from rewardplane.protocol import MAX_LAYOUTS
from rewardplane.server.weight_sync.worker_extension import HFWeightSyncWorker


def _worker() -> HFWeightSyncWorker:
    return HFWeightSyncWorker(torch.nn.Linear(4, 2), torch.device("cpu"))


def _meta(width: int) -> list[dict[str, object]]:
    return [{"name": "weight", "dtype": "float32", "shape": [2, width]}]


def test_unknown_layout_by_id_is_refused_before_anything_is_received() -> None:
    worker = _worker()
    out = worker.rp_receive(None, 1 << 16, True, "layout-a")
    assert out["unknown_layout"] is True and out["bytes"] == 0 and not out["ok"] and not out["partial"]
    # with its metadata once, the id alone is enough afterwards (here it stops at the missing group)
    worker.rp_receive(_meta(4), 1 << 16, True, "layout-a")
    again = worker.rp_receive(None, 1 << 16, True, "layout-a")
    assert "unknown_layout" not in again and "no communicator" in again["error"]


def test_layout_cache_evicts_first_in_first_out() -> None:
    worker = _worker()
    for i in range(MAX_LAYOUTS + 1):
        worker.rp_receive(_meta(4 + i), 1 << 16, True, f"layout-{i}")
    assert worker.rp_receive(None, 1 << 16, True, "layout-0").get("unknown_layout") is True
    assert "unknown_layout" not in worker.rp_receive(None, 1 << 16, True, "layout-1")  # a hit...
    worker.rp_receive(_meta(99), 1 << 16, True, "layout-new")
    assert (
        worker.rp_receive(None, 1 << 16, True, "layout-1").get("unknown_layout") is True
    )  # ...kept no place
    assert "unknown_layout" not in worker.rp_receive(None, 1 << 16, True, "layout-2")
