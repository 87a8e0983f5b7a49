"""A replica sends its weights to a peer from the worker that holds them (peer restore). Here the
worker is shaped as vLLM's: a loader that fuses q/k/v into one parameter and casts a bf16 head into
fp32, so the send reads each name back from where the copy plan saw the push land. The peer is this
test, on a real gloo group."""

from __future__ import annotations

import time

import torch

from rewardplane.protocol import ParamMeta, SendWeightsRequest
from rewardplane.testing.servers import free_port
from rewardplane.transport.buckets import meta_of
from rewardplane.transport.comm import create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.transfer import receive_buckets
from tests.fixtures.workers import CpuWorker

BUCKET = 256


class FusedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(1, 4), requires_grad=False)  # fp32, pushed as bf16
        self.scaled = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                self.qkv.data.narrow(0, "qkv".index(name) * 2, 2).copy_(w)
            elif name == "head":
                self.head.data.copy_(w)
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)  # computed from the tensor: cannot be read back


def pushed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(2, 4, generator=g) for n in ("q", "k", "v")}
    out["head"] = torch.randn(1, 4, generator=g).to(torch.bfloat16)
    return out


def receive(port: int, metas: list[ParamMeta], group_id: str) -> dict[str, torch.Tensor]:
    store = create_store("127.0.0.1", port, is_master=False, world_size=2, timeout_s=30)
    comm = open_group(
        store,
        rank=0,
        world_size=2,
        device=torch.device("cpu"),
        backend="gloo",
        timeout_s=30,
        group_id=group_id,
    )
    got: dict[str, torch.Tensor] = {}

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        got.update((n, t.clone()) for n, t in weights)

    try:
        received = receive_buckets(comm, metas, BUCKET, 1, load)
        assert received.error is None, received.error
        comm.max_flag(0)  # the sender's commit agreement
    finally:
        comm.close()
    return got


def send_to(port: int, timeout_s: float, group_id: str) -> dict[str, object]:
    """The worker call's request: a two-rank group on ``port``, one receiver."""
    req = SendWeightsRequest(
        port=port, world_size=2, version=1, bucket_bytes=BUCKET, timeout_s=timeout_s, group_id=group_id
    )
    return req.model_dump(mode="json")


def outcome_of(worker: CpuWorker, timeout_s: float = 30) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout_s
    while (outcome := worker.rp_peer_send_outcome()) is None:
        assert time.monotonic() < deadline, "the send did not end"
        time.sleep(0.02)
    return outcome


def test_a_vllm_shaped_worker_sends_what_the_last_push_loaded() -> None:
    worker = CpuWorker(FusedModel())
    for seed in (0, 1):
        worker.rp_load(list(pushed(seed).items()))
    want = pushed(1)
    metas = [meta_of(n, t) for n, t in want.items()]  # the manifest: the head is bf16 on the wire
    assert worker.rp_peer_send_problem([m.name for m in metas]) is None

    port = free_port()
    worker.rp_peer_send_start([m.model_dump(mode="json") for m in metas], send_to(port, 30.0, "peer-unit"))
    got = receive(port, metas, "peer-unit")
    ok, detail = outcome_of(worker)
    assert ok, detail
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_names_that_cannot_be_read_back_are_named_before_anything_moves() -> None:
    worker = CpuWorker(FusedModel())
    assert "not pushed to this replica since it started" in str(worker.rp_peer_send_problem(["q"]))
    worker.rp_load([*pushed(0).items(), ("scaled", torch.ones(4))])
    problem = worker.rp_peer_send_problem(["q", "k", "v", "head", "scaled"])
    assert problem is not None and "1 of 5" in problem and "scaled" in problem
    assert worker.rp_peer_send_outcome() == (False, "no send was started")


def test_a_peer_that_never_joins_ends_the_send_as_failed_not_hung() -> None:
    worker = CpuWorker(FusedModel())
    worker.rp_load(list(pushed(0).items()))
    metas = [meta_of(n, t) for n, t in pushed(0).items()]
    worker.rp_peer_send_start([m.model_dump(mode="json") for m in metas], send_to(free_port(), 1.0, "nobody"))
    ok, detail = outcome_of(worker, timeout_s=60)
    assert not ok and detail
