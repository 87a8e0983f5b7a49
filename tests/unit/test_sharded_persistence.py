"""Persisted weights of tensor-parallel replicas (``--weights-dir``): every worker saves the range of
each pushed tensor it keeps, whether the push went through the loader or arrived sliced, and a
restore puts each range back through the loader. The workers are the real worker extension over a
model whose loader narrows like vLLM's tensor-parallel layers (rows, columns, a replicated tensor);
the sliced push runs over a real gloo group."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rewardplane.protocol import plan_buckets
from rewardplane.protocol.slices import needs_from_json, needs_key, slice_schedule
from rewardplane.server.weight_sync.persistence import WeightsStore
from rewardplane.transport.comm import Communicator
from rewardplane.transport.slices import send_slices
from tests.fixtures.workers import CpuWorker
from tests.unit.test_atomic_sliced_staging import (
    BUCKET,
    LAYOUT,
    Joined,
    _atomic_push_applied,
    _both,
    _metas,
    _stage_sliced,
)

ROWS, COLS, TP = 4, 6, 2


class ShardedModel(torch.nn.Module):
    """Shard ``shard`` of ``tp``: ``up`` split by rows, ``down`` by columns, ``norm`` whole."""

    def __init__(self, shard: int, tp: int = TP) -> None:
        super().__init__()
        self.shard, self.tp = shard, tp
        self.up = torch.nn.Parameter(torch.zeros(ROWS // tp, COLS), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(COLS, ROWS // tp), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(COLS), requires_grad=False)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        n = ROWS // self.tp
        for name, w in weights:
            if name == "up":
                self.up.data.copy_(w.narrow(0, self.shard * n, n))
            elif name == "down":
                self.down.data.copy_(w.narrow(1, self.shard * n, n))
            else:
                self.norm.data.copy_(w)


class ShardWorker(CpuWorker):
    """The worker extension as a vLLM worker has it (its loader, learned by the copy plan), on CPU;
    ``rank`` is its place in the replica, ``shard`` the part its model keeps."""

    def __init__(self, shard: int, rank: int | None = None, tp: int = TP) -> None:
        super().__init__(ShardedModel(shard, tp), shard if rank is None else rank)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "up": torch.randn(ROWS, COLS, generator=g),
        "down": torch.randn(COLS, ROWS, generator=g),
        "norm": torch.randn(COLS, generator=g),
    }


def _shard_of(weights: dict[str, torch.Tensor], shard: int, tp: int = TP) -> dict[str, torch.Tensor]:
    model = ShardedModel(shard, tp)
    model.load_weights(list(weights.items()))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _params(worker: ShardWorker) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.model.named_parameters()}


def _persisted(worker: CpuWorker, version: int) -> None:
    assert worker.rp_persist(version)
    deadline = time.monotonic() + 30
    while worker.rp_persist_pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.rp_persist_pending()


def _pushed_through_the_loader(
    workers: list[ShardWorker], weights: dict[str, torch.Tensor], version: int
) -> None:
    for w in workers:
        w.rp_parts.state.kept = {}
        w.rp_parts.persistence.load_kept(list(weights.items()))
        _persisted(w, version)


def _lone(directory: Path, shard: int, tp: int = TP) -> ShardWorker:
    """A replica of one worker that keeps shard ``shard`` of ``tp`` (its rank is 0) and persists."""
    worker = ShardWorker(shard=shard, rank=0, tp=tp)
    worker.rp_persist_to(str(directory), "b", 1)
    return worker


def _restores_to(
    directory: Path, shard: int, weights: dict[str, torch.Tensor], version: int, tp: int = TP
) -> None:
    """A fresh lone worker restores ``version`` from ``directory`` to its shard of ``weights``."""
    restarted = _lone(directory, shard, tp)
    assert restarted.rp_restore(version) == len(weights)
    got, want = _params(restarted), _shard_of(weights, shard, tp)
    assert all(torch.equal(got[k], want[k]) for k in want)


@contextmanager
def _after_a_first_push(directory: Path, shard: int) -> Iterator[tuple[Joined, ShardWorker]]:
    """A lone persisting worker in a group with a trainer, after version 1 went through its loader
    (it learned its ranges, published them and saved the version)."""
    worker = _lone(directory, shard)
    joined = Joined(worker)
    try:
        _atomic_push_applied(joined, _weights(1))
        _persisted(worker, 1)
        yield joined, worker
    finally:
        joined.close()


def _replica(directory: Path, base: str = "b") -> list[ShardWorker]:
    workers = [ShardWorker(shard) for shard in range(TP)]
    for w in workers:
        w.rp_persist_to(str(directory), base, TP)
    return workers


def test_each_worker_saves_its_own_range_and_a_fresh_replica_restores_it(tmp_path: Path) -> None:
    first = _replica(tmp_path)
    _pushed_through_the_loader(first, _weights(1), version=1)
    _pushed_through_the_loader(first, {"norm": _weights(2)["norm"]}, version=2)  # the union grows
    store = WeightsStore(tmp_path, ranks=TP)
    assert store.saved_version() == 2 and store.saved_names() == {"up", "down", "norm"}
    for shard in range(TP):  # each file: this worker's rows of up, columns of down, all of norm
        with safe_open(str(tmp_path / f"pushed.rank{shard}-of-{TP}.safetensors"), framework="pt") as f:
            names = f.keys()
            assert {k: tuple(f.get_slice(k).get_shape()) for k in names} == {
                "up": (ROWS // TP, COLS),
                "down": (COLS, ROWS // TP),
                "norm": (COLS,),
            }
    want = {**_weights(1), "norm": _weights(2)["norm"]}

    restarted = _replica(tmp_path)
    assert [w.rp_restore(2) for w in restarted] == [3, 3]
    for shard, w in enumerate(restarted):
        got, expected = _params(w), _shard_of(want, shard)
        assert all(torch.equal(got[k], expected[k]) for k in expected), shard


def test_weights_saved_part_way_are_not_restorable(tmp_path: Path) -> None:
    workers = _replica(tmp_path)
    _pushed_through_the_loader(workers, _weights(1), version=1)
    _pushed_through_the_loader(workers[:1], _weights(2), version=2)  # worker 1's save never happened
    store = WeightsStore(tmp_path, ranks=TP)
    assert store.saved_version() is None
    assert "saved different versions (worker 0: 2, worker 1: 1)" in store.unsaved_reason()
    assert WeightsStore(tmp_path, ranks=1).saved_version() is None  # nor at another size
    with pytest.raises(LookupError, match="no persisted weights"):
        workers[1].rp_restore(2)


def test_a_replica_of_another_tensor_parallel_size_restores_and_keeps_the_union(tmp_path: Path) -> None:
    # The RewardModel went from TP=2 to TP=1 (the Pod's directory stays): whole tensors are put
    # together from both workers' ranges; the TP=1 union starts from them, so a later push of the
    # norm alone still restores with the rest.
    _pushed_through_the_loader(_replica(tmp_path), _weights(1), version=1)
    assert WeightsStore(tmp_path, ranks=1).saved_version() == 1
    _restores_to(tmp_path, 0, _weights(1), 1, tp=1)
    single = _lone(tmp_path, 0, tp=1)
    _pushed_through_the_loader([single], {"norm": _weights(2)["norm"]}, version=2)
    assert WeightsStore(tmp_path, ranks=1).saved_version() == 2
    _restores_to(tmp_path, 0, {**_weights(1), "norm": _weights(2)["norm"]}, 2, tp=1)


def test_a_return_to_an_earlier_size_restores_the_latest_weights_not_that_size_s_old_ones(
    tmp_path: Path,
) -> None:
    # TP=2 saved v1 (everything); then TP=1 lost its weights and was pushed v2, the norm alone, onto
    # the base; back at TP=2 the restore must give v2 (base + norm), not v1's backbone under v2.
    _pushed_through_the_loader(_replica(tmp_path), _weights(1), version=1)
    norm = {"norm": _weights(2)["norm"]}
    _pushed_through_the_loader([_lone(tmp_path, 0, tp=1)], norm, version=2)
    assert WeightsStore(tmp_path, ranks=TP).saved_version() == 2
    back = _replica(tmp_path)
    assert [w.rp_restore(2) for w in back] == [1, 1]
    assert WeightsStore(tmp_path, ranks=TP).saved_names() == {"norm"}  # v1's backbone is gone
    for shard, w in enumerate(back):
        got = _params(w)
        assert torch.equal(got["norm"], norm["norm"]) and not got["up"].any(), shard


def test_a_sliced_push_into_a_persisting_worker_is_saved_as_it_arrived(tmp_path: Path) -> None:
    # The worker keeps shard 1; first a push through the loader (it learns and publishes its ranges
    # even though it persists), then a streamed sliced push carrying only those ranges.
    with _after_a_first_push(tmp_path, 1) as (joined, worker):
        comm = joined.trainer
        assert comm.store.get(needs_key(LAYOUT, 0))  # published while persisting
        second = _weights(2)
        metas = _metas(second)

        def send(trainer: Communicator) -> None:
            regions = needs_from_json(trainer.store.get(needs_key(LAYOUT, 0)))
            assert trainer.max_flag(0) == 0  # the agreement: every worker takes it sliced
            send_slices(
                trainer, metas, second, slice_schedule(metas, plan_buckets(metas, BUCKET), {0: regions})
            )
            trainer.max_flag(0)

        out = _both(
            joined,
            send,
            lambda: worker.rp_receive(
                [m.model_dump() for m in metas], BUCKET, True, LAYOUT, agree_slicing=True
            ),
        )
        assert out["ok"] and out["sliced"], out
        assert out["bytes"] == sum(t.nbytes for t in _shard_of(second, 1).values())  # its ranges only
        _persisted(worker, 2)
    assert WeightsStore(tmp_path).saved_version() == 2
    _restores_to(tmp_path, 1, second, 2)


def test_an_atomic_sliced_push_is_saved_at_the_swap(tmp_path: Path) -> None:
    with _after_a_first_push(tmp_path, 0) as (joined, worker):
        _stage_sliced(joined, _weights(3))
        worker.rp_apply_staged([m.model_dump() for m in _metas(_weights(3))])
        _persisted(worker, 2)
    _restores_to(tmp_path, 0, _weights(3), 2)
