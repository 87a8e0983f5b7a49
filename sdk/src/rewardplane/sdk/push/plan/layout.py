"""What each rank of a sharded trainer holds, and who sends which bytes of a push.

A push from a multi-rank trainer never gathers a tensor: each rank sends the part it holds. This
module turns a rank's state dict (FSDP2 ``DTensor``s, tensor-parallel slices described by
:class:`TensorPiece`, or plain replicated tensors) into :class:`LocalPart` descriptions, and the
descriptions of every rank into one push layout: full shapes, and for each tensor either the one
rank that sends it whole (replicated tensors, spread over the ranks by bytes) or the pieces that
cover it. Pure logic, apart from reading the tensors' placements.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from rewardplane.protocol import DTYPE_ITEMSIZE, ParamMeta, Piece, canonical_dtype
from rewardplane.protocol.naming import WeightValidationError


@dataclass(frozen=True)
class TensorPiece:
    """A rank's slice of a tensor that no rank holds whole (e.g. a Megatron column- or row-parallel
    weight): ``local`` holds indices ``start .. start + local.shape[dim]`` along ``dim`` of a tensor
    of ``full_shape``."""

    local: torch.Tensor
    dim: int
    start: int
    full_shape: tuple[int, ...]

    @classmethod
    def even(cls, local: torch.Tensor, dim: int, rank: int, world_size: int) -> TensorPiece:
        """Rank ``rank``'s equal share along ``dim`` of ``world_size`` (Megatron's split)."""
        full = list(local.shape)
        full[dim] = local.shape[dim] * world_size
        return cls(local, dim, rank * local.shape[dim], tuple(full))


@dataclass(frozen=True)
class LocalPart:
    """What one rank holds of one state-dict entry: the whole tensor (``dim`` None) or the indices
    ``start:stop`` along ``dim``."""

    key: str
    dtype: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0


def local_parts(state_dict: Mapping[str, object]) -> tuple[dict[str, torch.Tensor], list[LocalPart]]:
    """This rank's tensors (key → what it sends: the local shard, or the whole tensor) and their
    descriptions. Raises ``WeightValidationError`` for what cannot be sent without gathering."""
    tensors: dict[str, torch.Tensor] = {}
    parts: list[LocalPart] = []
    for key, value in state_dict.items():
        if isinstance(value, TensorPiece):
            _check_piece(key, value)
            dim = value.dim % len(value.full_shape)
            tensors[key] = value.local.detach()
            parts.append(
                LocalPart(
                    key,
                    canonical_dtype(str(value.local.dtype)),
                    tuple(value.full_shape),
                    dim,
                    value.start,
                    value.start + value.local.shape[dim],
                )
            )
        elif _is_dtensor(value):
            local, part = _dtensor_part(key, value)
            tensors[key] = local
            parts.append(part)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value.detach()
            parts.append(LocalPart(key, canonical_dtype(str(value.dtype)), tuple(value.shape)))
        else:
            _not_pushable(key, value)
    return tensors, parts


def _not_pushable(key: str, value: object) -> NoReturn:
    raise WeightValidationError(
        f"{key!r} is a {type(value).__name__}; push tensors, DTensors or TensorPiece slices"
    )


class PartsBook:
    """:func:`local_parts` for one rank's successive pushes, with :func:`parts_digest`: when every
    entry has the key, kind, dtype and shape (and piece or placement) it had in the last call, that
    call's descriptions and digest are reused; only the tensors are taken again. The descriptions
    depend on nothing else, so fresh tensor objects (``model.state_dict()`` each push) reuse them
    too. Holds no tensor: the signatures keep shapes, dtypes and placements only."""

    def __init__(self) -> None:
        self._signature: list[tuple[Any, ...]] | None = None
        self._parts: list[LocalPart] = []
        self._digest = ""

    def describe(
        self, state_dict: Mapping[str, object]
    ) -> tuple[dict[str, torch.Tensor], list[LocalPart], str]:
        """This rank's tensors, their descriptions and the descriptions' digest (``local_parts``)."""
        tensors: dict[str, torch.Tensor] = {}
        signature: list[tuple[Any, ...]] = []
        dtensors: list[int] = []  # their local tensors take their place's shape (below)
        dtensor_type = _dtensor_type()
        # one pass, no description: the tuples' lengths (3, 5, 6) keep the kinds apart
        for key, value in state_dict.items():
            if isinstance(value, TensorPiece):
                local = value.local
                signature.append(
                    (key, local.dtype, local.shape, value.dim, value.start, tuple(value.full_shape))
                )
            elif dtensor_type is not None and isinstance(value, dtensor_type):
                dtensors.append(len(signature))
                local = value.to_local()
                signature.append((key, value.dtype, value.shape, value.placements, value.device_mesh))
            elif isinstance(value, torch.Tensor):
                local = value
                signature.append((key, value.dtype, value.shape))
            else:
                _not_pushable(key, value)
            # the wire reads the bytes alone: a tensor outside autograd is sent as it is
            tensors[key] = local.detach() if local.requires_grad else local
        if signature != self._signature:
            return self._describe_anew(state_dict, signature)
        for i in dtensors:  # as _dtensor_part: a padded or strided shard sends its place
            part = self._parts[i]
            shape = list(part.full_shape)
            if part.dim is not None:
                shape[part.dim] = part.stop - part.start
            local = tensors[part.key]
            if local.numel() == math.prod(shape):
                tensors[part.key] = local.reshape(shape)
        return tensors, self._parts, self._digest

    def _describe_anew(
        self, state_dict: Mapping[str, object], signature: list[tuple[Any, ...]]
    ) -> tuple[dict[str, torch.Tensor], list[LocalPart], str]:
        tensors, parts = local_parts(state_dict)  # raises for what is not pushable: nothing kept
        self._signature, self._parts, self._digest = signature, parts, parts_digest(parts)
        return tensors, parts, self._digest


def _check_piece(key: str, p: TensorPiece) -> None:
    rank = len(p.full_shape)
    if p.local.dim() != rank:
        raise WeightValidationError(f"{key!r}: a {p.local.dim()}-D slice of a {rank}-D tensor")
    dim = p.dim % rank if rank else 0
    want = list(p.full_shape)
    want[dim] = p.local.shape[dim]
    if rank == 0 or tuple(p.local.shape) != tuple(want) or p.start < 0:
        raise WeightValidationError(
            f"{key!r}: a slice of shape {list(p.local.shape)} at {p.start} along dimension {p.dim} does not "
            f"fit a tensor of shape {list(p.full_shape)}"
        )
    if p.start + p.local.shape[dim] > p.full_shape[dim]:
        raise WeightValidationError(
            f"{key!r}: indices {p.start}..{p.start + p.local.shape[dim]} along dimension {dim} exceed its "
            f"size {p.full_shape[dim]}"
        )


@functools.cache
def _dtensor_type() -> type[Any] | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed tensors
        return None
    return DTensor


def _is_dtensor(value: object) -> bool:
    dtensor_type = _dtensor_type()
    return dtensor_type is not None and isinstance(value, dtensor_type)


def _dtensor_part(key: str, value: object) -> tuple[torch.Tensor, LocalPart]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(value, DTensor)
    for placement in value.placements:
        if not isinstance(placement, Replicate | Shard):
            raise WeightValidationError(
                f"{key!r} has placement {placement}; reduce partial values (full_tensor() or "
                "redistribute to Shard/Replicate) before pushing"
            )
    full = tuple(value.shape)
    dtype = canonical_dtype(str(value.dtype))
    local = value.to_local().detach()
    local_shape, offset = compute_local_shape_and_global_offset(full, value.device_mesh, value.placements)
    split = [d for d in range(len(full)) if local_shape[d] != full[d]]
    if not split:
        return local, LocalPart(key, dtype, full)
    if len(split) > 1:
        raise WeightValidationError(
            f"{key!r} is sharded along dimensions {split}; pushes take tensors split along one dimension "
            "(redistribute it to one Shard placement first)"
        )
    dim = split[0]
    # a padded or strided shard's local tensor may differ in shape from its place: send its place
    local = local.reshape(local_shape) if local.numel() == math.prod(local_shape) else local
    return local, LocalPart(key, dtype, full, dim, int(offset[dim]), int(offset[dim] + local_shape[dim]))


def parts_digest(parts: Sequence[LocalPart]) -> str:
    """Names a rank's descriptions: each push compares it with the rank's last one, and the ranks
    exchange the descriptions only when some rank's changed."""
    h = hashlib.blake2b(digest_size=12)
    for p in parts:
        h.update(repr((p.key, p.dtype, p.full_shape, p.dim, p.start, p.stop)).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class PushPlan:
    """A push's layout from every rank's parts: key → metadata under that key (full shape; sender
    or pieces), in the keys' order; the caller renames and orders it for the servers."""

    metas: dict[str, ParamMeta]

    def only(self, keys: Sequence[str]) -> PushPlan:
        """The plan of ``keys`` alone (a delta push's subset), in that order, with the same senders."""
        return PushPlan({k: self.metas[k] for k in keys})

    def sent_by(self, sender: int) -> int:
        """Bytes rank ``sender`` sends per push (a balance check)."""
        return sum(n for m in self.metas.values() for s, _, n in m.wire_parts() if s == sender)


def plan_senders(ranks_parts: Sequence[Sequence[LocalPart]]) -> PushPlan:
    """Who sends what: every rank's parts (index = sender) → one layout.

    A tensor every rank holds whole is sent by one of them, the one with the fewest bytes so far
    (in the keys' order, so every rank computes the same); a split tensor's distinct pieces by
    their holders (the lowest rank where several hold the same piece), and they must cover it."""
    if not ranks_parts:
        raise ValueError("no ranks")
    keys = [p.key for p in ranks_parts[0]]
    by_rank = [{p.key: p for p in parts} for parts in ranks_parts]
    for rank, parts in enumerate(by_rank):
        if set(parts) != set(keys):
            missing = sorted(set(keys) - set(parts))[:3]
            extra = sorted(set(parts) - set(keys))[:3]
            raise WeightValidationError(
                f"trainer rank {rank} pushes different entries than rank 0 (missing {missing}, extra {extra}); "
                "every rank must pass the same state-dict keys"
            )
    load = [0] * len(ranks_parts)
    metas: dict[str, ParamMeta] = {}
    for key in keys:
        held = [parts[key] for parts in by_rank]
        first = held[0]
        for rank, p in enumerate(held):
            if (p.dtype, p.full_shape) != (first.dtype, first.full_shape):
                raise WeightValidationError(
                    f"{key!r}: rank {rank} holds {p.dtype} {list(p.full_shape)}, rank 0 "
                    f"{first.dtype} {list(first.full_shape)}; the ranks must describe the same tensor"
                )
        nbytes = math.prod(first.full_shape) * DTYPE_ITEMSIZE[first.dtype]
        whole = [r for r, p in enumerate(held) if p.dim is None]
        if whole:
            sender = min(whole, key=lambda r: (load[r], r))
            load[sender] += nbytes
            metas[key] = ParamMeta(name=key, dtype=first.dtype, shape=first.full_shape, sender=sender)
            continue
        dims = {p.dim for p in held}
        if len(dims) != 1:
            raise WeightValidationError(f"{key!r} is split along different dimensions on different ranks")
        dim = held[0].dim
        assert dim is not None
        pieces: dict[tuple[int, int], int] = {}
        for rank, p in enumerate(held):
            if p.stop > p.start:  # an empty shard (more ranks than rows) sends nothing
                pieces.setdefault((p.start, p.stop), rank)
        ordered = sorted(pieces.items())
        at = 0
        for (start, stop), rank in ordered:
            if start != at:
                what = "a gap" if start > at else "overlapping pieces"
                raise WeightValidationError(
                    f"{key!r}: the ranks' pieces along dimension {dim} leave {what} at index {min(at, start)} "
                    f"(rank {rank} holds {start}..{stop}); every index must be held by exactly one piece"
                )
            at = stop
        if at != first.full_shape[dim]:
            raise WeightValidationError(
                f"{key!r}: the ranks' pieces cover {at} of {first.full_shape[dim]} along dimension {dim}"
            )
        if len(ordered) == 1:  # one rank holds every row (e.g. a one-row head under FSDP)
            sender = ordered[0][1]
            load[sender] += nbytes
            metas[key] = ParamMeta(name=key, dtype=first.dtype, shape=first.full_shape, sender=sender)
            continue
        for (start, stop), rank in ordered:
            load[rank] += nbytes * (stop - start) // first.full_shape[dim]
        metas[key] = ParamMeta(
            name=key,
            dtype=first.dtype,
            shape=first.full_shape,
            split_dim=dim,
            pieces=tuple(Piece(sender=r, start=a, stop=b) for (a, b), r in ordered),
        )
    return PushPlan(metas)
