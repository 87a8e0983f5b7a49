"""Flat byte buckets on both sides of the data plane, laid out by ``protocol.plan_buckets``: a
server receives what it cannot take in place into one, and stages an atomic push in them."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from rewardplane.protocol import Bucket, ParamMeta, Piece, canonical_dtype

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[canonical_dtype(name)]


def meta_of(name: str, tensor: torch.Tensor) -> ParamMeta:
    return ParamMeta(name=name, dtype=str(tensor.dtype), shape=tuple(tensor.shape))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flat (a copy only if it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def unpack_bucket(
    bucket: Bucket, metadata: Sequence[ParamMeta], buf: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into a received bucket, with the announced dtype and shape (no copy)."""
    for slot in bucket.slots:
        meta = metadata[slot.index]
        raw = buf[slot.offset : slot.offset + slot.nbytes]
        yield meta.name, raw.view(torch_dtype(meta.dtype)).view(meta.shape)


def piece_view(full: torch.Tensor, meta: ParamMeta, piece: Piece) -> torch.Tensor:
    """The piece's place in ``full`` (the whole tensor, typed and shaped as announced): a view."""
    assert meta.split_dim is not None
    return full.narrow(meta.split_dim, piece.start, piece.stop - piece.start)


def piece_bytes(full_bytes: torch.Tensor, meta: ParamMeta, piece: Piece) -> torch.Tensor | None:
    """The piece's bytes inside ``full_bytes`` (the whole tensor's, flat) when they are contiguous
    there (a split along the first dimension of more than one element), else None."""
    assert meta.split_dim is not None
    if any(d != 1 for d in meta.shape[: meta.split_dim]):
        return None
    row = math.prod(meta.shape[meta.split_dim + 1 :]) * torch_dtype(meta.dtype).itemsize
    return full_bytes[piece.start * row : piece.stop * row]
