"""Why a pushed tensor goes through the server's loader instead of straight into its parameter
(``transport.transfer.why_not_in_place``), and the one log line a layout's second push writes
when part of it did: a push through the loader costs CPU time per tensor on every push, so the
reason is what a user (or the colocated benchmark) needs to see."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from rewardplane.protocol import ParamMeta, plan_buckets
from rewardplane.transport.transfer import receive_buckets, why_not_in_place

CPU = torch.device("cpu")


def meta(name: str = "w", shape: tuple[int, ...] = (4, 8), dtype: str = "bfloat16") -> ParamMeta:
    return ParamMeta(name=name, shape=list(shape), dtype=dtype)


def test_an_exact_fit_lands_in_place_and_every_misfit_is_named() -> None:
    param = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert why_not_in_place(meta(), param, CPU) is None
    assert why_not_in_place(meta(), None, CPU)[0] == "no place"  # type: ignore[index]
    kind, detail = why_not_in_place(meta(), param.float(), CPU)  # type: ignore[misc]
    assert kind == "dtype" and "torch.float32" in detail and "torch.bfloat16" in detail
    kind, detail = why_not_in_place(meta(shape=(8, 4)), param, CPU)  # type: ignore[misc]
    assert kind == "shape" and "(4, 8)" in detail and "(8, 4)" in detail
    strided = torch.zeros(8, 4, dtype=torch.bfloat16).t()
    assert why_not_in_place(meta(), strided, CPU)[0] == "layout"  # type: ignore[index]
    assert why_not_in_place(meta(), param, torch.device("meta"))[0] == "device"  # type: ignore[index]


class NoWire:
    """A group whose broadcasts move nothing: what is measured here is where each tensor lands."""

    device = CPU
    first_sender = 1

    def broadcast_group(self, tensors: Sequence[torch.Tensor], src: int | Sequence[int]) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_a_layouts_second_push_says_once_what_went_through_the_loader(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metas = [meta("a"), meta("head", shape=(1, 8))]
    served = {"a": torch.zeros(4, 8, dtype=torch.bfloat16), "head": torch.zeros(1, 8)}  # an fp32 head
    plan = plan_buckets(metas, 1 << 20)
    comm = NoWire()
    caplog.set_level(logging.INFO, logger="rewardplane.transport.transfer")
    for _ in range(3):
        got = receive_buckets(
            comm,  # type: ignore[arg-type]
            metas,
            1 << 20,
            1,
            lambda items: None,
            plan=plan,
            place=lambda m: served[m.name],
        )
        assert got.in_place_bytes == 64 and got.through_loader == {"dtype": 16}
        assert got.through_loader_example["dtype"].startswith("head: served as torch.float32")
    said = [r.getMessage() for r in caplog.records if "went through the loader" in r.getMessage()]
    assert len(said) == 1, said  # the second push of the layout, not the first (which learns) or later ones
    assert said[0].startswith(f"16 of {got.bytes} bytes") and "dtype" in said[0] and "head" in said[0]
