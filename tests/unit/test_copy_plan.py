"""The copy plan loads pushed tensors exactly as the model's own loader would, and learns which
names it may copy straight into the parameters (copy_plan.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from rewardplane.protocol.slices import Region
from rewardplane.server.weight_sync.copy_plan import CopyPlan


class FusedModel(torch.nn.Module):
    """vLLM's shape of things: q/k/v fused into one parameter, loaders that narrow and copy, one
    that transforms, one that copies into scratch, one name it skips."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 3), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(1, 3, dtype=torch.float32), requires_grad=False)
        self.scaled = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.moved = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.calls: list[list[str]] = []

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append([n for n, _ in weights])
        rows = {"q": (0, 2), "k": (2, 2), "v": (4, 2)}
        for name, w in weights:
            if name in rows:
                start, size = rows[name]
                assert w.shape == (size, 3)  # metadata reads are fine
                self.qkv.data.narrow(0, start, size).copy_(w)
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)  # a loader that computes from the tensor
            elif name == "moved":
                scratch = torch.empty_like(self.moved)
                scratch.copy_(w)  # copied unchanged, but into scratch, then rearranged
                self.moved.data.copy_(scratch.flip(0))
            elif name == "rotary.inv_freq":
                continue
            else:
                getattr(self, name).data.copy_(w)


def push(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (2, 3), "k": (2, 3), "v": (2, 3), "o": (3, 3), "scaled": (2,), "moved": (2,)}
    weights = [(n, torch.randn(*s, generator=g)) for n, s in shapes.items()]
    weights.append(("head", torch.randn(1, 3, generator=g).to(torch.bfloat16)))  # bf16 into fp32
    weights.append(("rotary.inv_freq", torch.randn(4, generator=g)))
    return weights


def assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module, seed: int) -> None:
    mine, theirs = dict(got.named_parameters()), dict(want.named_parameters())
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), (seed, name)


def pushed_through_a_plan(planned: FusedModel, pushes: int) -> CopyPlan:
    """Pushes 0..``pushes``-1 into ``planned`` through a copy plan and into a plain ``FusedModel``
    through its loader; the parameters must be equal after every push."""
    reference = FusedModel()
    plan = CopyPlan(planned.load_weights, planned)
    for seed in range(pushes):
        weights = push(seed)
        plan.load(weights)
        reference.load_weights(weights)
        assert_same_parameters(planned, reference, seed)
    return plan


def test_the_plan_loads_what_the_loader_loads_and_copies_directly_where_it_may() -> None:
    planned = FusedModel()
    plan = pushed_through_a_plan(planned, 3)
    # learned on the first push: the fused slices, the plain parameters and the cast head
    assert plan.direct_names == {"q", "k", "v", "o", "head"}
    # later pushes hand the loader only what it alone can load
    assert planned.calls[0] == [n for n, _ in push(0)]
    assert planned.calls[1] == planned.calls[2] == ["scaled", "moved", "rotary.inv_freq"]


def test_the_plan_says_why_a_name_stays_with_the_loader(caplog: pytest.LogCaptureFixture) -> None:
    model = FusedModel()
    plan = CopyPlan(model.load_weights, model)
    with caplog.at_level(logging.INFO, logger="rewardplane.server.weight_sync.copy_plan"):
        plan.load(push(0))
    why = plan.why_loader("scaled")
    assert why is not None and why.startswith("the loader called ") and why.endswith(".mul on it")
    assert plan.why_loader("moved") == "the loader copied it into a tensor that is not a parameter"
    assert plan.why_loader("rotary.inv_freq") == (
        "the loader did not copy it (skipped, or read its values another way)"
    )
    assert plan.why_loader("q") is None
    (line,) = [r.getMessage() for r in caplog.records if "copy plan:" in r.getMessage()]
    assert line.startswith("copy plan: 3 of 8 names stay with the model's loader: ")
    assert ".mul on it: 1, e.g. scaled" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rewardplane.server.weight_sync.copy_plan"):
        plan.load(push(1))  # nothing new learned: nothing said again
    assert not [r for r in caplog.records if "copy plan:" in r.getMessage()]


def test_forget_sends_everything_through_the_loader_again() -> None:
    model = FusedModel()
    plan = CopyPlan(model.load_weights, model)
    plan.load(push(0))
    plan.forget()
    plan.load(push(1))
    assert plan.direct_names == {"q", "k", "v", "o", "head"}
    assert model.calls[1] == [n for n, _ in push(1)]


def test_a_name_pushed_in_another_shape_goes_through_the_loader() -> None:
    model = FusedModel()
    plan = CopyPlan(model.load_weights, model)
    plan.load(push(0))
    wrong = [("o", torch.ones(9))]
    try:
        plan.load(wrong)
    except Exception:
        pass  # the loader's own error; what matters is that no direct copy reshaped it silently
    assert model.calls[-1] == ["o"]


class OwnTorchFunction(torch.nn.Parameter):
    """A parameter type with its own ``__torch_function__``, as vLLM's ``BasevLLMParameter``: it
    answers torch calls on it before any other tensor type would see them."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


class NarrowingModel(torch.nn.Module):
    """vLLM 0.24's loaders for unquantized linear layers (``weight_loader_v2``): the loaded tensor
    is always narrowed to this rank's shard — the whole tensor at tensor-parallel size 1."""

    def __init__(self, tp_size: int) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.gate_up = OwnTorchFunction(torch.zeros(8 // tp_size, 3), requires_grad=False)

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            shard = ("gate", "up").index(name)
            size = 4 // self.tp_size
            dst = self.gate_up.data.narrow(0, shard * size, size)
            dst.copy_(w.narrow(0, 0, size))  # rank 0's shard


def test_full_size_views_and_parameter_types_with_their_own_torch_function_are_followed() -> None:
    model = NarrowingModel(tp_size=1)
    plan = CopyPlan(model.load_weights, model)
    first = [("gate", torch.randn(4, 3)), ("up", torch.randn(4, 3))]
    plan.load(first)
    assert plan.direct_names == {"gate", "up"}
    second = [("gate", torch.randn(4, 3)), ("up", torch.randn(4, 3))]
    plan.load(second)
    assert torch.equal(model.gate_up.data, torch.cat([second[0][1], second[1][1]]))


def test_a_tensor_parallel_shard_is_learned_with_the_region_it_keeps() -> None:
    model = NarrowingModel(tp_size=2)
    plan = CopyPlan(model.load_weights, model)
    plan.load([("gate", torch.randn(4, 3)), ("up", torch.randn(4, 3))])
    assert plan.direct_names == {"gate", "up"}
    kept = plan.slice_of("up")
    assert kept is not None and kept[0] == Region(0, 0, 2)
    assert plan.target("up") is None and plan.held("up") is None  # only a slice of it lives here
    second = [("gate", torch.randn(4, 3)), ("up", torch.randn(4, 3))]
    plan.load(second)  # copied without the loader: rank 0's rows of each, side by side
    assert torch.equal(model.gate_up.data, torch.cat([second[0][1][:2], second[1][1][:2]]))
    assert torch.equal(kept[1], second[1][1][:2])


class RowParallelModel(torch.nn.Module):
    """vLLM's row-parallel loader on rank 1 of 2: a range of the input dimension (columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.down.data.copy_(w.narrow(-1, 2, 2))


def test_a_column_range_is_learned_and_copied_from_then_on() -> None:
    model = RowParallelModel()
    plan = CopyPlan(model.load_weights, model)
    plan.load([("down", torch.randn(3, 4))])
    kept = plan.slice_of("down")
    assert kept is not None and kept[0] == Region(1, 2, 4)
    again = torch.randn(3, 4)
    plan.load([("down", again)])
    assert torch.equal(model.down.data, again[:, 2:])


def test_a_narrow_of_a_narrow_stays_with_the_loader() -> None:
    class Twice(RowParallelModel):
        @torch.no_grad()
        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
            for _, w in weights:
                self.down.data.copy_(w.narrow(0, 0, 3).narrow(1, 2, 2))

    model = Twice()
    plan = CopyPlan(model.load_weights, model)
    plan.load([("down", torch.randn(4, 4))])
    assert not plan.direct_names and plan.slice_of("down") is None


class CloningModel(FusedModel):
    """vLLM's pooling adapter clones the first tensor of every call before loading it."""

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        weights = list(weights)
        if weights:
            weights[0] = (weights[0][0], weights[0][1].clone())
        super().load_weights(weights)


def test_a_clone_of_the_pushed_tensor_is_followed_like_the_tensor() -> None:
    plan = pushed_through_a_plan(CloningModel(), 2)
    assert "q" in plan.direct_names  # the first tensor, cloned by the loader


def test_a_tensor_changed_in_place_stays_with_the_loader() -> None:
    class Scaling(FusedModel):
        def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
            for _, w in weights:
                w.mul_(1.0)  # in place: whatever it does, the pushed values are not what is copied
            super().load_weights(weights)

    model = Scaling()
    plan = CopyPlan(model.load_weights, model)
    plan.load(push(0))
    assert not plan.direct_names


def test_what_a_plan_holds_reads_back_as_the_last_push_for_a_peer() -> None:
    """A replica sends its weights to a peer by reading each name back from where the plan copied
    it: the last push's values (a bf16 head read back from its fp32 parameter casts back exactly);
    names the loader transformed, copied elsewhere or skipped cannot be read back."""
    plan = pushed_through_a_plan(FusedModel(), pushes=2)
    last = dict(push(1))
    for name in ("q", "k", "v", "o"):
        held = plan.held(name)
        assert held is not None and torch.equal(held, last[name]), name
    head = plan.held("head")
    assert head is not None and torch.equal(head.to(torch.bfloat16), last["head"])
    assert [plan.held(n) for n in ("scaled", "moved", "rotary.inv_freq", "never-pushed")] == [None] * 4
    plan.forget()  # the weights moved (a sleep discarded them): nothing can be read back
    assert plan.held("q") is None
