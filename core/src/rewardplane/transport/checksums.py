"""Exact fingerprints of tensors, the same on both sides of a push: the server's
``GET /param_checksums`` hashes its live parameters with ``tensor_digest``, a trainer hashes its own."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes (row-major, its own dtype); copies it to host memory."""
    t = tensor.detach().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, str, list[int]]]:
    """name → (digest, dtype, shape), as ``/param_checksums`` reports each worker's parameters."""
    return {name: (tensor_digest(t), str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named}
