"""The per-tensor wire over a real gloo group (two ranks, one process): every byte arrives through
the loader; a server receives in place only where its placer's tensor really fits, and loads the
rest; staging never writes in place; the wire is part of every layout's id, and no environment
variable changes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rewardplane.protocol import ParamMeta, layout_id, plan_buckets
from rewardplane.protocol import weights as wire
from rewardplane.transport.buckets import meta_of, unpack_bucket
from rewardplane.transport.comm import Communicator
from rewardplane.transport.transfer import Received, receive_buckets, send_buckets
from tests.fixtures.gloo import run_gloo_world

BUCKET = 4096  # small: several buckets, several tensors in some


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(40, 16, generator=g),
        "layer.q.weight": torch.randn(16, 16, generator=g),
        "layer.k.weight": torch.randn(8, 16, generator=g),
        "layer.norm.weight": torch.randn(16, generator=g),
        "head.weight": torch.randn(1, 16, generator=g).to(torch.bfloat16),
        "layer.mlp.weight": torch.randn(64, 16, generator=g),
    }


def _run_pair(sender: Callable[[Communicator], Any], receiver: Callable[[Communicator], Any]) -> Any:
    """Rank 1 sends, rank 0 receives, each on its own thread over one gloo group."""
    return run_gloo_world([receiver, sender])[0]


def test_every_tensor_arrives_through_the_loader() -> None:
    sent = _tensors()
    metas = [meta_of(n, t) for n, t in sent.items()]
    loaded: dict[str, torch.Tensor] = {}

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            loaded[name] = t.clone()

    got = _run_pair(
        lambda c: send_buckets(c, metas, sent, BUCKET, src=1),
        lambda c: receive_buckets(c, metas, BUCKET, 1, load),
    )
    assert isinstance(got, Received) and got.error is None and got.in_place_bytes == 0
    assert got.bytes == sum(b.nbytes for b in plan_buckets(metas, BUCKET))
    assert set(loaded) == set(sent)
    for name, t in sent.items():
        assert torch.equal(loaded[name], t), name


def test_tensors_that_fit_are_received_in_place_and_the_rest_loaded() -> None:
    sent = _tensors()
    metas = [meta_of(n, t) for n, t in sent.items()]
    fused = torch.zeros(24, 16)  # q and k land in row slices of one fused parameter
    params = {
        "embed.weight": torch.zeros(40, 16),
        "layer.q.weight": fused[:16],
        "layer.k.weight": fused[16:],
        "layer.norm.weight": torch.zeros(16),
        "head.weight": torch.zeros(1, 16),  # float32 served, bfloat16 pushed: a cast, the loader's
        "layer.mlp.weight": torch.zeros(16, 64).t(),  # not contiguous: never received into
    }
    loaded: list[str] = []

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            params[name].copy_(t)
            loaded.append(name)

    def place(meta: ParamMeta) -> torch.Tensor | None:
        return params[meta.name]

    got = _run_pair(
        lambda c: send_buckets(c, metas, sent, BUCKET, src=1),
        lambda c: receive_buckets(c, metas, BUCKET, 1, load, place=place),
    )
    assert got.error is None and got.applied_any
    assert sorted(loaded) == ["head.weight", "layer.mlp.weight"]
    in_place = ["embed.weight", "layer.q.weight", "layer.k.weight", "layer.norm.weight"]
    assert got.in_place_bytes == sum(sent[n].nbytes for n in in_place)
    for name, t in sent.items():
        assert torch.equal(params[name], t.to(params[name].dtype)), name
    assert torch.equal(fused, torch.cat([sent["layer.q.weight"], sent["layer.k.weight"]]))


def test_staging_never_writes_in_place() -> None:
    sent = _tensors()
    metas = [meta_of(n, t) for n, t in sent.items()]
    params = {n: torch.zeros_like(t) for n, t in sent.items()}
    got = _run_pair(
        lambda c: send_buckets(c, metas, sent, BUCKET, src=1),
        lambda c: receive_buckets(c, metas, BUCKET, 1, None, place=lambda m: params[m.name]),
    )
    assert got.in_place_bytes == 0 and not got.applied_any
    assert all(not p.any() for p in params.values())  # the served weights are untouched
    staged = {n: t for bucket, buf in got.staged for n, t in unpack_bucket(bucket, metas, buf)}
    for name, t in sent.items():
        assert torch.equal(staged[name], t), name


def test_the_wire_shape_is_part_of_the_layout_id(monkeypatch: pytest.MonkeyPatch) -> None:
    metas = [meta_of(n, t) for n, t in _tensors().items()]
    ours = layout_id(metas, BUCKET)
    for name in ("REWARDPLANE_PER_TENSOR_WIRE", "REWARDPLANE_FIRST_BUCKET_SHARE"):  # retired: no effect
        monkeypatch.setenv(name, "0")
    assert layout_id(metas, BUCKET) == ours
    monkeypatch.setattr(wire, "WIRE_LAYOUT", "packed buckets")  # another version's wire
    assert layout_id(metas, BUCKET) != ours  # a server on the other wire refuses the layout


def test_the_per_tensor_wire_starts_with_a_short_bucket() -> None:
    """No byte moves until both sides posted a bucket's broadcasts; a short first bucket starts the
    link early."""
    small = [ParamMeta(name=f"norm{i}", dtype="float32", shape=(25,)) for i in range(3)]  # 100 B each
    rest = [ParamMeta(name=f"w{i}", dtype="float32", shape=(128,)) for i in range(12)]  # 512 B each
    limit = BUCKET // wire.FIRST_BUCKET_SHARE
    plan = plan_buckets(small + rest, BUCKET)
    assert [s.index for s in plan[0].slots] == [0, 1] and plan[0].nbytes <= limit
    assert max(b.nbytes for b in plan[1:]) > limit  # the others fill up to BUCKET
    assert all(b.nbytes <= BUCKET for b in plan)
    embed_first = plan_buckets([meta_of(n, t) for n, t in _tensors().items()], BUCKET)
    assert len(embed_first[0].slots) == 1  # larger than the limit: alone
