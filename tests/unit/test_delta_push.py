"""The pure parts of delta pushes: what is sent, the header rules, and when a replica refuses."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rewardplane.protocol import PushHeader, UpdateParamBatchRequest, delta_refusal
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.sdk.push.plan.delta import changed_names, delta_names, fingerprints, smallest_name
from rewardplane.server.locking import WeightsGuard
from rewardplane.transport.checksums import device_fingerprint

META = [{"name": "score.weight", "dtype": "float32", "shape": [1, 4]}]


def test_changed_names_are_the_new_and_the_different_in_order():
    acked = {"a": "1", "b": "2", "gone": "9"}
    assert changed_names({"c": "3", "a": "1", "b": "x"}, acked) == ["c", "b"]
    assert changed_names({"a": "1", "b": "2"}, acked) == []


def test_nothing_changed_sends_the_smallest_tensor_deterministically():
    sizes = {"big": 100, "z": 4, "y": 4}
    assert smallest_name(sizes) == "y"
    assert delta_names({"big": "1"}, {"big": "1"}, sizes) == ["y"]
    assert delta_names({"big": "2"}, {"big": "1"}, sizes) == ["big"]


def test_fingerprints_see_values_dtypes_and_shapes():
    t = torch.arange(6, dtype=torch.float32)
    base = fingerprints({"t": t})["t"]
    assert fingerprints({"t": t.clone()})["t"] == base
    bumped = t.clone()
    bumped[3] += 1e-6
    assert fingerprints({"t": bumped})["t"] != base
    assert fingerprints({"t": t.view(2, 3)})["t"] != base  # same bytes, another shape
    assert fingerprints({"t": t.view(torch.int32)})["t"] != base  # same bytes, another dtype


def test_the_device_fingerprint_sees_one_bit_a_swap_and_a_tail_byte():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3 * (1 << 20) + 5, generator=g).to(torch.bfloat16)  # spans chunks, odd byte count
    base = device_fingerprint(t)
    assert device_fingerprint(t.clone()) == base
    for i in (0, 1 << 20, t.numel() - 1):
        flipped = t.clone()
        flipped.view(torch.int16)[i] ^= 1  # one bit
        assert device_fingerprint(flipped) != base, i
    swapped = t.clone()
    swapped[[7, 9]] = t[[9, 7]]
    assert device_fingerprint(swapped) != base
    assert device_fingerprint(torch.tensor([1], dtype=torch.uint8)) != device_fingerprint(
        torch.tensor([2], dtype=torch.uint8)
    )
    assert len(device_fingerprint(torch.empty(0))) == 32


def test_base_version_goes_with_full_pushes_older_than_the_version():
    UpdateParamBatchRequest(metadata=META, version=3, base_version=2)
    PushHeader(seq=0, version=3, layout_id="0" * 16, bucket_bytes=256, base_version=2)
    with pytest.raises(ValidationError, match="older than"):
        UpdateParamBatchRequest(metadata=META, version=2, base_version=2)
    with pytest.raises(ValidationError, match="full only"):
        UpdateParamBatchRequest(metadata=META, version=3, base_version=2, training_mode=Mode.HEAD_ONLY)
    with pytest.raises(ValidationError, match="full only"):
        PushHeader(
            seq=0, version=3, layout_id="0" * 16, bucket_bytes=256, base_version=2, training_mode=Mode.LORA
        )


@pytest.mark.parametrize(
    ("served", "state", "delta_base", "reason"),
    [
        (2, "serving", 2, None),
        (3, "serving", 3, "serves version 3, not 2"),
        (2, "broken", None, "broken"),
        (2, "sleeping", 2, "sleeping"),
        (2, "serving", None, "restarted or was restored"),
    ],
)
def test_a_replica_refuses_a_delta_unless_it_holds_the_base_as_pushed(served, state, delta_base, reason):
    refusal = delta_refusal(2, served=served, state=state, delta_base=delta_base)
    assert refusal is None if reason is None else reason in refusal


def test_only_a_push_leaves_a_delta_base():
    guard = WeightsGuard()
    assert guard.delta_base is None  # a fresh process
    guard.commit(4)
    assert guard.delta_base == 4
    guard.commit(4, pushed=False)  # a restore
    assert guard.delta_base is None
    guard.commit(5)
    guard.mark_broken("a failed update")
    assert guard.delta_base is None
