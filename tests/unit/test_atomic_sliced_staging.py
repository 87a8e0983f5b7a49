"""An atomic sliced push on a worker (the transformers engine's, real gloo groups on threads): an
atomic push applied through the loader publishes the worker's slices; the next atomic push is
received in their shapes and reaches the parameters only at the swap; a staged push whose
parameters were reloaded in between is refused at the swap instead of writing into stale places."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import pytest
import torch

from rewardplane.protocol import ParamMeta, plan_buckets
from rewardplane.protocol.slices import needs_from_json, needs_key, slice_schedule
from rewardplane.server.weight_sync.worker.group import GroupJoin
from rewardplane.server.weight_sync.worker_extension import HFWeightSyncWorker, RewardWeightSyncExtension
from rewardplane.testing.servers import free_port
from rewardplane.transport.comm import Communicator, create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.slices import send_slices
from rewardplane.transport.transfer import Received, send_buckets

LAYOUT = "layout-a"
BUCKET = 1 << 16


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(3, generator=g)}


class Joined:
    """A worker (rank 0) and the trainer (rank 1, host of the store) in one gloo group; ``worker``:
    one that was in another group before (a new group per push, as through the operator)."""

    def __init__(self, worker: RewardWeightSyncExtension | None = None) -> None:
        port = free_port()
        self.worker = worker or HFWeightSyncWorker(torch.nn.Linear(4, 3), torch.device("cpu"))
        made: list[Communicator] = []

        def trainer_joins() -> None:
            store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=30)
            made.append(
                open_group(
                    store, rank=1, world_size=2, device=torch.device("cpu"), timeout_s=30, group_id="g"
                )
            )

        t = threading.Thread(target=trainer_joins)
        t.start()
        self.worker.rp_init_communicator(asdict(GroupJoin("127.0.0.1", port, 2, 0, "gloo", 30, "g")))
        t.join(30)
        self.trainer = made[0]

    def close(self) -> None:
        self.worker.rp_close_communicator()
        self.trainer.close()


def _both(joined: Joined, trainer: Callable[[Communicator], Any], worker: Callable[[], Any]) -> Any:
    """``trainer`` on the trainer's rank (a thread) beside ``worker`` on this thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            trainer(joined.trainer)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    try:
        return worker()
    finally:
        t.join(30)
        assert not t.is_alive(), "the trainer's side hung"
        if errors:
            raise errors[0]


@pytest.fixture
def joined() -> Iterator[Joined]:
    pair = Joined()
    yield pair
    pair.close()


def _metas(weights: dict[str, torch.Tensor]) -> list[ParamMeta]:
    return [ParamMeta(name=k, dtype=str(v.dtype), shape=tuple(v.shape)) for k, v in weights.items()]


def _atomic_push_applied(joined: Joined, weights: dict[str, torch.Tensor]) -> None:
    metas = _metas(weights)

    def send(comm: Communicator) -> None:
        send_buckets(comm, metas, weights, BUCKET, src=1)
        comm.max_flag(0)

    worker = joined.worker
    out = _both(
        joined, send, lambda: worker.rp_receive([m.model_dump() for m in metas], BUCKET, False, LAYOUT)
    )
    assert out["ok"], out
    worker.rp_apply_staged([m.model_dump() for m in metas])


def _stage_sliced(joined: Joined, weights: dict[str, torch.Tensor]) -> Received:
    metas = _metas(weights)
    plan = plan_buckets(metas, BUCKET)
    got = Received()

    def send(comm: Communicator) -> None:
        regions = needs_from_json(comm.store.get(needs_key(LAYOUT, 0)))  # what the worker published
        send_slices(comm, metas, weights, slice_schedule(metas, plan, {0: regions}))

    worker = joined.worker
    comm = worker.rp_parts.state.comm
    assert comm is not None
    _both(joined, send, lambda: worker.rp_parts.slices.receive(comm, LAYOUT, metas, got, stage=True))
    return got


def _params(worker: HFWeightSyncWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.rp_model().named_parameters()}


def test_an_atomic_sliced_push_reaches_the_parameters_only_at_the_swap(joined: Joined) -> None:
    worker, first, second = joined.worker, _weights(1), _weights(2)
    _atomic_push_applied(joined, first)  # through the loader: the worker learns and publishes
    assert all(torch.equal(_params(worker)[k], first[k]) for k in first)
    got = _stage_sliced(joined, second)
    assert got.bytes == sum(t.nbytes for t in second.values())
    assert got.in_place_bytes == 0 and not got.applied_any  # staged: no parameter touched
    assert all(torch.equal(_params(worker)[k], first[k]) for k in first)  # the old version serves
    worker.rp_apply_staged([m.model_dump() for m in _metas(second)])
    assert all(torch.equal(_params(worker)[k], second[k]) for k in second)


def test_a_staged_sliced_push_is_refused_once_the_parameters_moved(joined: Joined) -> None:
    worker, first = joined.worker, _weights(1)
    _atomic_push_applied(joined, first)
    _stage_sliced(joined, _weights(3))
    worker.rp_parts.slices.forget_places()  # what reloading the weights (a level-2 wake) does
    with pytest.raises(RuntimeError, match="reloaded after the atomic push was received"):
        worker.rp_apply_staged([m.model_dump() for m in _metas(first)])
    assert all(torch.equal(_params(worker)[k], first[k]) for k in first)


def test_a_sliced_push_without_room_to_stage_is_refused_with_the_way_out(
    joined: Joined, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = joined.worker
    _atomic_push_applied(joined, _weights(1))  # the worker publishes: 3x4 + 3 floats, 60 bytes
    assert worker.rp_parts.slices.staging_problem(LAYOUT, atomic=True) is None
    # one bucket of 60 bytes: streamed, two in flight (120 bytes) fit; atomic, 120 + 60 do not
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "150")
    assert worker.rp_parts.slices.staging_problem(LAYOUT, atomic=False) is None
    problem = worker.rp_parts.slices.staging_problem(LAYOUT, atomic=True)
    assert problem is not None and "until the swap" in problem and "bucket_bytes" in problem, problem
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "100")
    problem = worker.rp_parts.slices.staging_problem(LAYOUT, atomic=False)
    assert problem is not None and "REWARDPLANE_PUSH_SLICING=never" in problem, problem
