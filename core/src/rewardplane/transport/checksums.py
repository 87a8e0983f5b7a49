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


_FINGERPRINT_CHUNK_WORDS = 1 << 22  # 4M words a step: 32 MB of int64 scratch per temporary
_GOLDEN = -0x61C8864680B583EB  # 2^64 / golden ratio, as int64: spreads the second sum's weights
_MASK64 = (1 << 64) - 1


def device_fingerprint(tensor: torch.Tensor) -> str:
    """A 128-bit fingerprint of the tensor's bytes, computed on the tensor's own device (no copy to
    the host, so a GPU reads a 7B model in milliseconds): two sums of its 32-bit words, each word
    with its own odd weight, modulo 2^64. Not a cryptographic hash (``tensor_digest`` is): it tells
    a changed tensor from an unchanged one unless the change was built to collide (any single
    changed word, and any swap of two words, changes it)."""
    t = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if t.numel() % 4:
        t = torch.cat([t, t.new_zeros(4 - t.numel() % 4)])
    words = t.view(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    mixed = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _FINGERPRINT_CHUNK_WORDS):
        w = words[start : start + _FINGERPRINT_CHUNK_WORDS].to(torch.int64)
        idx = torch.arange(start, start + w.numel(), dtype=torch.int64, device=words.device)
        plain += (w * (2 * idx + 1)).sum()  # int64 arithmetic wraps: the sums are modulo 2^64
        mixed += (w * ((idx * _GOLDEN) | 1)).sum()
    return f"{int(plain) & _MASK64:016x}{int(mixed) & _MASK64:016x}"


def digests(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, str, list[int]]]:
    """name → (digest, dtype, shape), as ``/param_checksums`` reports each worker's parameters."""
    return {name: (tensor_digest(t), str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named}
