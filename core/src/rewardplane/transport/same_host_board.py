"""Words in shared memory that the ranks of a same-host group poll instead of store keys: each
rank's flag for every status reduction and its acknowledgement counters, and each sending rank's
messages (where a broadcast's tensors are).

A store round trip is a TCP exchange with the trainer's store thread, tens of microseconds each,
and a status reduction through the store costs several of them on every rank (write, check until
all are there, read, delete): about half a millisecond of a push's fixed cost. Here each rank owns
one small file in ``SHM_DIR`` that only it writes (``create_for_readers``: a server may run as
another user) and every other rank maps read-only; a word is one aligned 64-bit store, so a reader
sees a whole value or the previous one. What does not fit a word (a flag with a note: the exports
the receivers are to close) still goes through the store, named by a bit of the word.

Layout of a rank's board, in 64-bit words: ``FLAG_RING`` flags (reduction ``n`` in word
``n % FLAG_RING``, as ``(n + 1) << 24 | note << 23 | value``; a rank is never more than one
reduction ahead of another, so a small ring is safe), then one acknowledgement counter per
sending rank (how many of that sender's broadcasts this rank has copied); a sending rank's board
then holds ``MESSAGE_RING`` message slots of ``MESSAGE_SLOT_BYTES``: broadcast ``seq``'s in slot
``seq % MESSAGE_RING`` as ``[seq + 1][length][body]``, the first word written last (a message too
long for its slot is in the store, under ``same_host_memory.message_key``, and its length is -1).
A sender reuses a slot only once every receiver acknowledged the broadcast that used it before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading

import torch.distributed as dist

from .same_host_memory import MESSAGE_RING, SHM_DIR, unlink

FLAG_RING = 8
_WORD = struct.Struct("@q")  # native: one aligned 8-byte load or store
_ROUND_SHIFT = 24
_NOTE_BIT = 1 << 23
FLAG_VALUE_LIMIT = _NOTE_BIT  # larger values ride in the note
MESSAGE_SLOT_BYTES = 16 * 1024  # a 1 GiB bucket of a 7B model's message is about 1 KB
MESSAGE_BODY_LIMIT = MESSAGE_SLOT_BYTES - 2 * _WORD.size
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier (a lock's acquire and release): a message's body and length are seen
    by another process before the word saying they are there, on weakly ordered CPUs too."""
    with _FENCE:
        pass


def board_key(rank: int) -> str:
    """The store key under which ``rank`` publishes its board's path."""
    return f"b/{rank}"


def _word_count(world_size: int) -> int:
    return FLAG_RING + world_size


class SignalBoard:
    """This rank's board (written) and its peers' (read), opened when first needed."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, name: str, sender: bool) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._messages_at = _WORD.size * _word_count(world_size)
        self._size = self._messages_at + (MESSAGE_RING * MESSAGE_SLOT_BYTES if sender else 0)
        self.path: str | None = os.path.join(SHM_DIR, f"rewardplane-{name}-board-{rank}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fchmod(fd, 0o644)  # readable by a peer running as another user, whatever the umask
            os.ftruncate(fd, self._size)
            self._mine = mmap.mmap(fd, self._size)
        finally:
            os.close(fd)
        self._peers: dict[int, mmap.mmap] = {}
        self._acks = [0] * world_size  # what this rank has acknowledged, by sender
        store.set(board_key(rank), f"{self._size}|{self.path}")

    # ---- this rank's words --------------------------------------------------------------------

    def write_flag(self, n: int, value: int, note: bool) -> None:
        word = (n + 1) << _ROUND_SHIFT | (_NOTE_BIT if note else 0) | value
        _WORD.pack_into(self._mine, _WORD.size * (n % FLAG_RING), word)

    def add_acks(self, root: int, count: int) -> None:
        self._acks[root] += count
        _WORD.pack_into(self._mine, _WORD.size * (FLAG_RING + root), self._acks[root])

    def post_message(self, seq: int, body: bytes | None) -> None:
        """Broadcast ``seq``'s message (None: it is in the store, too long for a slot)."""
        at = self._messages_at + (seq % MESSAGE_RING) * MESSAGE_SLOT_BYTES
        if body is not None:
            if len(body) > MESSAGE_BODY_LIMIT:
                raise ValueError(f"a {len(body)}-byte message does not fit a {MESSAGE_BODY_LIMIT}-byte slot")
            self._mine[at + 2 * _WORD.size : at + 2 * _WORD.size + len(body)] = body
        _WORD.pack_into(self._mine, at + _WORD.size, -1 if body is None else len(body))
        _fence()
        _WORD.pack_into(self._mine, at, seq + 1)

    # ---- peers' words -------------------------------------------------------------------------

    def message(self, rank: int, seq: int) -> tuple[bool, bytes | None]:
        """Whether sender ``rank`` posted broadcast ``seq``'s message, and its body (None where it
        is in the store)."""
        board, at = self._board(rank), self._messages_at + (seq % MESSAGE_RING) * MESSAGE_SLOT_BYTES
        (posted,) = _WORD.unpack_from(board, at)
        if posted != seq + 1:
            return False, None
        _fence()
        (length,) = _WORD.unpack_from(board, at + _WORD.size)
        return True, None if length < 0 else bytes(board[at + 2 * _WORD.size : at + 2 * _WORD.size + length])

    def flag(self, rank: int, n: int) -> tuple[int, bool] | None:
        """``rank``'s flag for reduction ``n`` as (value, whether a note is in the store), or None
        while it has not written it."""
        (word,) = _WORD.unpack_from(self._board(rank), _WORD.size * (n % FLAG_RING))
        if word >> _ROUND_SHIFT != n + 1:
            return None
        return word & (_NOTE_BIT - 1), bool(word & _NOTE_BIT)

    def acks(self, rank: int, root: int) -> int:
        """How many of ``root``'s broadcasts ``rank`` has acknowledged."""
        (count,) = _WORD.unpack_from(self._board(rank), _WORD.size * (FLAG_RING + root))
        return int(count)

    def open_peers(self) -> None:
        """Map every peer's board. The last rank to map a board removes its file (the mappings
        stay valid), so none is left behind by a process that dies before it closes the group."""
        for rank in range(self.world_size):
            if rank != self.rank and rank not in self._peers:
                size, _, path = bytes(self.store.get(board_key(rank))).decode().partition("|")
                with open(path, "rb") as f:
                    self._peers[rank] = mmap.mmap(f.fileno(), int(size), prot=mmap.PROT_READ)
                if int(self.store.add(f"{board_key(rank)}/mapped", 1)) == self.world_size - 1:
                    # in /dev/shm (sticky) only its owner may: a server running as another user
                    # leaves it to the owner, which removes it after its second reduction
                    with contextlib.suppress(PermissionError):
                        unlink(path)

    def _board(self, rank: int) -> mmap.mmap:
        if rank == self.rank:
            return self._mine
        board = self._peers.get(rank)
        if board is None:
            self.open_peers()
            board = self._peers[rank]
        return board

    def unlink(self) -> None:
        """Remove this rank's file (where the last peer to map it has not): every peer mapped it."""
        if self.path is not None:
            unlink(self.path)
            self.path = None

    def close(self) -> None:
        self.unlink()
        for board in self._peers.values():
            board.close()
        self._peers.clear()
