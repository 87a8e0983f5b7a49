"""Slicing agreed per push (pushes through the operator form a new group for every push): a worker
publishes the places it learned in an earlier group into each new group's store as it joins, and
the trainer and the worker agree in one reduction whether the push is sliced. The transformers
engine's worker and real gloo groups on threads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rewardplane.protocol import layout_id, plan_buckets
from rewardplane.sdk.push.plan.slices import agree_on_slices
from rewardplane.transport.comm import Communicator
from rewardplane.transport.slices import send_slices
from rewardplane.transport.transfer import send_buckets

from .test_atomic_sliced_staging import BUCKET, Joined, _both, _metas, _params, _weights


def _push(joined: Joined, weights: dict[str, torch.Tensor]) -> tuple[dict, bool]:
    """A streamed push announced with the agreement: (the worker's result, whether the trainer sliced)."""
    metas = _metas(weights)
    layout, plan = layout_id(metas, BUCKET), plan_buckets(metas, BUCKET)
    sliced: list[bool] = []

    def trainer(comm: Communicator) -> None:
        schedule = agree_on_slices(comm, layout, metas, plan, decides=True)
        sliced.append(schedule is not None)
        if schedule is not None:
            send_slices(comm, metas, weights, schedule)
        else:
            send_buckets(comm, metas, weights, BUCKET, src=1, plan=plan)
        comm.max_flag(0)

    def worker() -> dict:
        return joined.worker.rp_receive([m.model_dump() for m in metas], BUCKET, True, layout, True)

    out = _both(joined, trainer, worker)
    assert out["ok"], out
    return out, sliced[0]


@pytest.fixture(autouse=True)
def _always_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    # one worker keeps every tensor whole: slicing moves no fewer bytes, so ``auto`` would broadcast
    monkeypatch.setenv("REWARDPLANE_PUSH_SLICING", "always")


def _worker_after_a_first_push() -> Any:
    """A worker that took one push in a group now closed: nothing was published before it, so the
    trainer and the worker agreed on a broadcast."""
    first = Joined()
    out, sliced = _push(first, _weights(1))
    assert (out["sliced"], sliced) == (False, False)
    worker = first.worker
    first.close()
    return worker


def _push_in_a_new_group(worker: Any, version: int) -> tuple[bool, bool]:
    """``_weights(version)`` pushed to ``worker`` in a new group and store, as the operator forms for
    every push; checks that the worker holds them after. Whether (the worker, the trainer) sliced."""
    second = Joined(worker)
    try:
        out, sliced = _push(second, _weights(version))
        assert all(torch.equal(_params(worker)[k], _weights(version)[k]) for k in ("weight", "bias"))
        return out["sliced"], sliced
    finally:
        second.close()


def test_a_worker_takes_its_places_into_the_next_group_and_the_push_there_is_sliced() -> None:
    worker = _worker_after_a_first_push()
    assert _push_in_a_new_group(worker, 2) == (True, True)


def test_a_worker_without_room_to_stage_its_share_makes_the_push_a_broadcast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = _worker_after_a_first_push()
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "10")  # less than one bucket's 60 bytes
    # the trainer wanted it sliced; the worker did not
    assert _push_in_a_new_group(worker, 2) == (False, False)


def test_reloaded_weights_leave_nothing_to_publish_in_the_next_group() -> None:
    worker = _worker_after_a_first_push()
    worker.rp_parts.slices.forget_places()  # what reloading the weights (a level-2 wake) does
    assert _push_in_a_new_group(worker, 3) == (False, False)
