"""What the same-host sender publishes of a tensor handed to it as flat bytes: the tensor itself
when it is contiguous (no view per tensor), its bytes copied out when it is a strided view, since
a receiver reads an exported tensor as one byte range of its storage."""

from __future__ import annotations

import torch

from rewardplane.transport.same_host_memory import flat_bytes as _flat_bytes


def test_contiguous_flat_bytes_are_sent_as_they_are() -> None:
    t = torch.arange(64, dtype=torch.uint8)
    assert _flat_bytes(t) is t
    assert _flat_bytes(t[8:40]).data_ptr() == t[8:].data_ptr()  # a slice is still one byte range


def test_a_strided_byte_view_is_sent_as_its_own_bytes() -> None:
    t = torch.arange(64, dtype=torch.uint8)
    strided = t[::2]
    out = _flat_bytes(strided)
    assert out.is_contiguous() and torch.equal(out, strided)
    # read as the byte range [offset, offset + numel) of the storage, the view would give other bytes
    span = t[strided.storage_offset() : strided.storage_offset() + strided.numel()]
    assert not torch.equal(span, strided)


def test_typed_tensors_are_viewed_as_bytes() -> None:
    t = torch.randn(4, 3, dtype=torch.bfloat16)
    out = _flat_bytes(t)
    assert out.dtype is torch.uint8 and out.numel() == t.numel() * 2 and out.data_ptr() == t.data_ptr()
