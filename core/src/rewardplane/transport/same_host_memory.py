"""What both sides of the same-host transport share: the messages that say where a broadcast's
tensors are, and the shared memory they are read from (files in ``/dev/shm`` on CPU;
CUDA IPC handles travel inside the messages).

Store keys, in the group's namespace (the rest is in each rank's board, ``same_host_board``):
- ``b/{rank}``: the size and path of ``rank``'s signal board; ``b/{rank}/mapped``: how many peers
  mapped it (the last removes its file).
- ``d/{seq % MESSAGE_RING}/{root}``: where broadcast ``seq``'s tensors of sending rank ``root``
  are, as ``"{seq}|{entries}"``, for a message too long for its board slot (the board says so).
  A ring of keys, overwritten, never deleted.
- ``f/{n}/{rank}``: a status reduction's flag that does not fit the board's word, with what the
  receivers are to close (``SameHostCommunicator.max_flag``).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import warnings
from typing import Any

import torch

from .buckets import as_bytes

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# How many broadcasts' messages a sender keeps posted: more than a push has buckets in flight (two
# staging buffers, or a few buckets read in place), so a sender seldom waits to reuse a slot.
MESSAGE_RING = 64
# The version of these messages; ranks that speak different ones refuse to form a group
# (``placement.choose_transport``) instead of waiting for keys the other never writes.
WIRE_VERSION = 4

# (key of the memory, how to open it (sent the first time only), offset, bytes)
Entry = tuple[str, tuple[Any, ...], int, int]


def message_key(seq: int, root: int) -> str:
    return f"d/{seq % MESSAGE_RING}/{root}"


def encode(entries: list[Entry]) -> bytes:
    """A message's body: JSON (the store is reachable from the network: nothing executable),
    handles as hex."""

    def plain(v: Any) -> Any:
        return {"hex": v.hex()} if isinstance(v, bytes) else v

    return json.dumps([[key, [plain(v) for v in source], off, n] for key, source, off, n in entries]).encode()


def decode(body: bytes) -> list[Entry]:
    """The entries of a message's body (in the store, what follows ``"{seq}|"``)."""

    def typed(v: Any) -> Any:
        return bytes.fromhex(v["hex"]) if isinstance(v, dict) else v

    return [(key, tuple(typed(v) for v in source), off, n) for key, source, off, n in json.loads(body)]


def create_for_readers(path: str, nbytes: int) -> torch.Tensor:
    """A new shared file for the trainer to write: torch creates it 0600, and the receivers (a
    server may run as another user) need to read it."""
    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    os.chmod(path, 0o644)
    return buf


def map_for_reading(path: str, nbytes: int) -> torch.Tensor:
    """The trainer's file mapped shared and read-only: a receiver needs no write permission on it,
    and sees every bucket the trainer writes into it later."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": this side only copies out
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)  # keeps `mapped` alive


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat. The wire hands flat bytes already, which need no new view (a push's CPU
    time is per tensor, and here it is not hidden behind a link); contiguous ones only: an export is
    read as bytes [offset, offset + numel) of its storage, which a strided view's bytes are not."""
    return t if t.dtype is torch.uint8 and t.dim() == 1 and t.is_contiguous() else as_bytes(t)


def aligned(n: int) -> int:
    return (n + 255) // 256 * 256


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def alive(pid: int | None) -> bool:
    """False only when ``pid`` surely exited (gone, or a zombie not reaped yet)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True
