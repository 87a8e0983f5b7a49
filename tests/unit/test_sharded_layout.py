"""Who sends what in a push from several trainer ranks: every rank's parts (FSDP2 DTensors, tensor-
parallel slices, replicated tensors) become one layout, or a clear error naming the tensor and the
ranks; the pieces' wire format; and the wire itself over a real gloo group of two senders and two
receivers (threads of one process), split by rows and by columns, in place and through the loader."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from rewardplane.protocol import InitCommunicatorRequest, ParamMeta, Piece, layout_id, plan_buckets
from rewardplane.protocol.naming import WeightValidationError
from rewardplane.protocol.slices import Region, needs_from_json, needs_to_json, slice_schedule
from rewardplane.sdk.push.plan.layout import (
    LocalPart,
    PartsBook,
    TensorPiece,
    local_parts,
    parts_digest,
    plan_senders,
)
from rewardplane.testing.servers import free_port
from rewardplane.transport.comm import Communicator
from rewardplane.transport.slices import receive_slices, send_slices
from rewardplane.transport.transfer import receive_buckets, send_buckets
from tests.fixtures.gloo import run_gloo_world


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),
        "layer.q.weight": torch.randn(16, 16, generator=g),  # split by rows
        "layer.o.weight": torch.randn(16, 12, generator=g),  # split by columns
        "layer.norm.weight": torch.randn(16, generator=g),  # replicated
        "head.weight": torch.randn(1, 16, generator=g),  # one row: one rank holds it all
        "layer.b.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
    }


def _rank_state(rank: int, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What trainer rank ``rank`` of two holds: halves by rows, halves by columns, whole."""
    return {
        "embed.weight": TensorPiece.even(full["embed.weight"].chunk(2)[rank], 0, rank, 2),
        "layer.q.weight": TensorPiece.even(full["layer.q.weight"].chunk(2)[rank], 0, rank, 2),
        "layer.o.weight": TensorPiece.even(full["layer.o.weight"].chunk(2, 1)[rank].contiguous(), 1, rank, 2),
        "layer.norm.weight": full["layer.norm.weight"],
        "head.weight": TensorPiece(full["head.weight"][: 1 - rank], 0, 0, (1, 16)),  # rank 1: empty
        "layer.b.weight": full["layer.b.weight"],
    }


def test_split_tensors_get_pieces_and_replicated_ones_one_sender_each() -> None:
    full = _full()
    parts = [local_parts(_rank_state(r, full))[1] for r in (0, 1)]
    plan = plan_senders(parts)
    q = plan.metas["layer.q.weight"]
    assert q.split_dim == 0 and q.pieces == (
        Piece(sender=0, start=0, stop=8),
        Piece(sender=1, start=8, stop=16),
    )
    o = plan.metas["layer.o.weight"]
    assert o.split_dim == 1 and [p.sender for p in o.pieces] == [0, 1]
    head = plan.metas["head.weight"]  # one rank holds every row: sent whole by it
    assert not head.pieces and head.sender == 0
    # the two replicated tensors go to different ranks: the one with fewer bytes so far
    assert {plan.metas["layer.norm.weight"].sender, plan.metas["layer.b.weight"].sender} == {0, 1}
    total = sum(m.nbytes for m in plan.metas.values())
    assert plan.sent_by(0) + plan.sent_by(1) == total
    assert min(plan.sent_by(0), plan.sent_by(1)) > 0.35 * total


def test_a_dtensor_sharded_by_fsdp_becomes_pieces() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # one process, a mesh of one (two trainer processes with FSDP2: tests/integration/test_sharded_push.py)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.arange(12.0).reshape(4, 3)
        sharded = distribute_tensor(w, mesh, [Shard(0)])
        replicated = distribute_tensor(w, mesh, [Replicate()])
        tensors, parts = local_parts({"w": sharded, "r": replicated})
        # on a mesh of one the shard is the whole tensor: sent whole
        assert parts == [LocalPart("w", "float32", (4, 3)), LocalPart("r", "float32", (4, 3))]
        assert torch.equal(tensors["w"], w)
        book = PartsBook()
        for _ in range(2):  # described, then reused
            got, got_parts, _ = book.describe({"w": sharded, "r": replicated})
            assert got_parts == parts and torch.equal(got["w"], w) and torch.equal(got["r"], w)
        assert book.describe({"w": sharded, "r": sharded})[1] is not got_parts  # another placement
    finally:
        dist.destroy_process_group()


def test_a_parts_book_describes_again_only_what_changed_shape_or_kind() -> None:
    full = _full()
    book = PartsBook()
    tensors, parts, digest = book.describe(_rank_state(0, full))
    assert (parts, digest) == (local_parts(_rank_state(0, full))[1], parts_digest(parts))
    want = local_parts(_rank_state(0, full))[0]
    assert tensors.keys() == want.keys() and all(torch.equal(tensors[k], v) for k, v in want.items())
    # the very same objects, and fresh ones of the same shapes (state_dict() each push): reused
    state = _rank_state(0, full)
    assert book.describe(state)[1] is book.describe(state)[1]
    fresh = {k: v.clone() for k, v in full.items()}
    again, reused, _ = book.describe(_rank_state(0, fresh))
    assert reused is parts and again["layer.norm.weight"] is fresh["layer.norm.weight"]
    # another shape, dtype, piece, kind, key or order: described again, as local_parts does
    changed: list[dict[str, Any]] = [
        {**state, "layer.norm.weight": torch.zeros(8)},
        {**state, "layer.norm.weight": full["layer.norm.weight"].double()},
        {**state, "layer.q.weight": TensorPiece(full["layer.q.weight"][8:], 0, 8, (16, 16))},
        {**state, "layer.b.weight": TensorPiece.even(full["layer.b.weight"].chunk(2)[0], 0, 0, 2)},
        {**state, "extra": torch.zeros(2)},
        dict(reversed(state.items())),
    ]
    for other in changed:
        got, got_parts, got_digest = book.describe(other)
        want_tensors, want_parts = local_parts(other)
        assert got_parts == want_parts and got_digest == parts_digest(want_parts) != digest
        assert got.keys() == want_tensors.keys()
    # the same tensor object resized in place: its new shape is described
    t = torch.zeros(4, 4)
    book.describe({"t": t})
    t.resize_(2, 4)
    assert book.describe({"t": t})[1] == [LocalPart("t", "float32", (2, 4))]
    # a bad piece raises every time; the last good descriptions stay
    bad = {"w": TensorPiece(torch.zeros(3, 4), 0, 2, (4, 4))}
    for _ in range(2):
        with pytest.raises(WeightValidationError, match="exceed its size"):
            book.describe(bad)
        with pytest.raises(WeightValidationError, match="push tensors"):
            book.describe({"t": t, "n": 3})
    assert book.describe({"t": t})[1] == [LocalPart("t", "float32", (2, 4))]


def test_a_parts_book_keeps_no_tensor_alive() -> None:
    book = PartsBook()
    state: dict[str, Any] = {"w": TensorPiece(torch.zeros(4, 4), 0, 0, (8, 4)), "r": torch.ones(3)}
    refs = [weakref.ref(state["w"]), weakref.ref(state["w"].local), weakref.ref(state["r"])]
    for _ in range(2):
        tensors, _, _ = book.describe(state)
    del state, tensors
    gc.collect()
    assert all(r() is None for r in refs)


def test_tensors_in_autograd_are_sent_detached() -> None:
    w = torch.nn.Parameter(torch.ones(4, 4))
    book = PartsBook()
    for _ in range(2):  # described, then reused
        tensors, _, _ = book.describe({"w": w, "p": TensorPiece(w[:2], 0, 0, (4, 4))})
        assert not tensors["w"].requires_grad and not tensors["p"].requires_grad
        assert tensors["w"].data_ptr() == w.data_ptr()


def test_pieces_that_leave_a_gap_or_overlap_are_refused_naming_the_tensor() -> None:
    def piece(start: int, stop: int) -> LocalPart:
        return LocalPart("layer.q.weight", "float32", (16, 16), 0, start, stop)

    with pytest.raises(WeightValidationError, match="'layer.q.weight'.*gap at index 6"):
        plan_senders([[piece(0, 6)], [piece(8, 16)]])
    with pytest.raises(WeightValidationError, match="'layer.q.weight'.*overlapping pieces"):
        plan_senders([[piece(0, 10)], [piece(8, 16)]])
    with pytest.raises(WeightValidationError, match="cover 8 of 16"):
        plan_senders([[piece(0, 8)], [piece(0, 8)]])  # the same piece twice (HSDP): still half


def test_ranks_must_describe_the_same_tensors() -> None:
    a = LocalPart("w", "float32", (4, 4))
    with pytest.raises(WeightValidationError, match="rank 1 pushes different entries.*missing \\['w'\\]"):
        plan_senders([[a], [LocalPart("v", "float32", (4, 4))]])
    with pytest.raises(WeightValidationError, match="rank 1 holds bfloat16"):
        plan_senders([[a], [LocalPart("w", "bfloat16", (4, 4))]])
    with pytest.raises(WeightValidationError, match="does not fit a tensor of shape"):
        local_parts({"w": TensorPiece(torch.zeros(3, 4), 0, 0, (4, 5))})
    with pytest.raises(WeightValidationError, match="exceed its size"):
        local_parts({"w": TensorPiece(torch.zeros(3, 4), 0, 2, (4, 4))})


def test_the_digest_changes_with_any_part() -> None:
    a = [LocalPart("w", "float32", (4, 4), 0, 0, 2)]
    assert parts_digest(a) == parts_digest(list(a))
    assert parts_digest(a) != parts_digest([LocalPart("w", "float32", (4, 4), 0, 0, 3)])


def _rows_from_two_senders(shape: tuple[int, int], first_rows: int) -> ParamMeta:
    """``w`` of ``shape`` split along its rows: sender 0 sends the first ``first_rows``, sender 1 the
    rest."""
    return ParamMeta(
        name="w",
        dtype="float32",
        shape=shape,
        split_dim=0,
        pieces=(Piece(sender=0, start=0, stop=first_rows), Piece(sender=1, start=first_rows, stop=shape[0])),
    )


def test_pieces_travel_in_the_metadata_and_the_layout_id_only_when_present() -> None:
    whole = ParamMeta(name="w", dtype="float32", shape=(4, 3))
    assert whole.model_dump(mode="json") == {"name": "w", "dtype": "float32", "shape": [4, 3]}
    # a one-sender layout keeps its id (servers of every version name it alike)
    assert layout_id([whole], 1024) == "707ba81473244abb"
    split = _rows_from_two_senders((4, 3), 1)
    assert ParamMeta.model_validate(split.model_dump(mode="json")) == split
    assert layout_id([split], 1024) != layout_id([whole], 1024)
    assert layout_id([whole.model_copy(update={"sender": 1})], 1024) != layout_id([whole], 1024)
    with pytest.raises(ValidationError, match="at most one piece"):
        ParamMeta(
            name="w",
            dtype="float32",
            shape=(4, 3),
            split_dim=0,
            pieces=(Piece(sender=0, start=0, stop=1), Piece(sender=0, start=1, stop=4)),
        )
    with pytest.raises(ValidationError, match="split_dim within"):
        ParamMeta(
            name="w", dtype="float32", shape=(4,), split_dim=1, pieces=(Piece(sender=0, start=0, stop=4),)
        )
    with pytest.raises(ValidationError, match="sending rank"):
        InitCommunicatorRequest(host="h", port=1, world_size=3, rank_offset=1, senders=2)


@pytest.mark.parametrize("in_place", [False, True])
def test_two_senders_deliver_every_tensor_whole_to_every_receiver(in_place: bool) -> None:
    full = _full()
    states = [local_parts(_rank_state(r, full)) for r in (0, 1)]
    plan = plan_senders([parts for _, parts in states])
    metas = [plan.metas[n] for n in sorted(plan.metas)]
    bucket = 1024  # several buckets, split tensors among them
    received: list[dict[str, torch.Tensor]] = [{}, {}]

    def receiver(i: int) -> Callable[[Communicator], Any]:
        params = {n: torch.zeros_like(t) for n, t in full.items()}
        received[i] = params

        def load(weights: list[tuple[str, torch.Tensor]]) -> None:
            for name, t in weights:
                params[name].copy_(t)

        def place(meta: ParamMeta) -> torch.Tensor | None:
            return params[meta.name] if in_place else None

        return lambda c: receive_buckets(c, metas, bucket, c.first_sender, load, place=place)

    def sender(i: int) -> Callable[[Communicator], Any]:
        tensors = states[i][0]
        return lambda c: send_buckets(c, metas, tensors, bucket, c.first_sender, sender=i)

    got = run_gloo_world([receiver(0), receiver(1), sender(0), sender(1)], senders=2)
    assert got[2] == got[3] == sum(b.nbytes for b in plan_buckets(metas, bucket))
    for r in (0, 1):
        assert got[r].error is None
        assert got[r].in_place_bytes == (sum(t.nbytes for t in full.values()) if in_place else 0)
        for name, t in full.items():
            assert torch.equal(received[r][name], t), (r, name)


# What each of two tensor-parallel receivers keeps: rows, columns across the senders' row split
# (a 2-D box), columns along the senders' own column split, whole tensors, and columns of a tensor
# one sender holds whole (sent from a contiguous copy).
_KEPT: dict[str, Callable[[int], Region | None]] = {
    "embed.weight": lambda r: Region(0, 20 * r, 20 * r + 20),
    "layer.q.weight": lambda r: Region(1, 8 * r, 8 * r + 8),
    "layer.o.weight": lambda r: Region(1, 6 * r, 6 * r + 6),
    "layer.norm.weight": lambda r: None,
    "head.weight": lambda r: None,
    "layer.b.weight": lambda r: Region(1, 2 * r, 2 * r + 2),
}


def _kept(t: torch.Tensor, region: Region | None) -> torch.Tensor:
    return t if region is None else t.narrow(region.dim, region.start, region.stop - region.start)


@pytest.mark.parametrize("bucket_bytes", [1024, 1 << 20])
def test_a_sliced_push_gives_each_receiver_only_what_it_keeps(bucket_bytes: int) -> None:
    full = _full()
    states = [local_parts(_rank_state(r, full)) for r in (0, 1)]
    plan = plan_senders([parts for _, parts in states])
    metas = [plan.metas[n] for n in sorted(plan.metas)]
    buckets = plan_buckets(metas, bucket_bytes)
    needs = {r: [_KEPT[m.name](r) for m in metas] for r in (0, 1)}
    schedule = slice_schedule(metas, buckets, needs)
    # receiver 1 keeps the bf16 tensor as float32: received into scratch, cast into place
    targets = [
        [torch.zeros_like(_kept(full[m.name], needs[r][i]), dtype=torch.float32) for i, m in enumerate(metas)]
        for r in (0, 1)
    ]
    targets[0] = [t.to(full[m.name].dtype) for t, m in zip(targets[0], metas, strict=True)]

    def receiver(r: int) -> Callable[[Communicator], Any]:
        return lambda c: receive_slices(
            c, metas, slice_schedule(metas, buckets, {r: needs[r]}), r, 2, needs[r], targets[r]
        )

    def sender(i: int) -> Callable[[Communicator], Any]:
        return lambda c: send_slices(c, metas, states[i][0], schedule, sender=i)

    got = run_gloo_world([receiver(0), receiver(1), sender(0), sender(1)], senders=2)
    for r in (0, 1):
        for i, m in enumerate(metas):
            expected = _kept(full[m.name], needs[r][i]).to(targets[r][i].dtype)
            assert torch.equal(targets[r][i], expected), (r, m.name)
        kept = sum(_kept(full[m.name], needs[r][i]).nbytes for i, m in enumerate(metas))
        assert got[r].bytes == kept < sum(t.nbytes for t in full.values())  # only its share moved
    if bucket_bytes < 2048:  # a bucket per tensor or two: single-box messages land in place
        assert 0 < got[0].in_place_bytes < got[0].bytes
    else:  # one bucket: every pair's boxes travel packed in one message
        assert got[0].in_place_bytes == got[1].in_place_bytes == 0
    assert got[1].in_place_bytes <= got[1].bytes - full["layer.b.weight"].nbytes // 2  # a cast: staged
    assert got[2] + got[3] == got[0].bytes + got[1].bytes  # nothing sent twice


def test_the_schedule_pairs_pieces_with_what_each_receiver_keeps() -> None:
    meta = _rows_from_two_senders((4, 6), 2)
    plan = plan_buckets([meta], 1 << 20)
    rows = slice_schedule([meta], plan, {0: [Region(0, 0, 2)], 1: [Region(0, 2, 4)]})
    assert [(t.sender, t.receiver, t.box) for t in rows[0]] == [
        (0, 0, ((0, 2), (0, 6))),
        (1, 1, ((2, 4), (0, 6))),
    ]
    cols = slice_schedule([meta], plan, {0: [Region(1, 0, 3)], 1: [None]})
    assert [(t.sender, t.receiver, t.box) for t in cols[0]] == [
        (0, 0, ((0, 2), (0, 3))),
        (0, 1, ((0, 2), (0, 6))),
        (1, 0, ((2, 4), (0, 3))),
        (1, 1, ((2, 4), (0, 6))),
    ]
    assert needs_from_json(needs_to_json([Region(1, 0, 3), None])) == [Region(1, 0, 3), None]
    with pytest.raises(ValueError, match="not a range inside it"):
        slice_schedule([meta], plan, {0: [Region(1, 4, 9)]})
    with pytest.raises(ValueError, match="regions for 2 tensors"):
        slice_schedule([meta], plan, {0: [None, None]})
