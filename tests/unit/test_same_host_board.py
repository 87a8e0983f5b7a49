"""The same-host transport's signal boards: flags and acknowledgement counters that one rank
writes in shared memory and the others read, with no store round trip per look."""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from rewardplane.transport.same_host_board import (
    FLAG_RING,
    FLAG_VALUE_LIMIT,
    MESSAGE_BODY_LIMIT,
    SignalBoard,
)
from rewardplane.transport.same_host_memory import MESSAGE_RING, SHM_DIR

OPENED: list[SignalBoard] = []


@pytest.fixture(autouse=True)
def close_boards() -> Iterator[None]:
    """Every board a test made is closed after it: no file is left in shared memory."""
    yield
    while OPENED:
        OPENED.pop().close()


def boards(world_size: int) -> tuple[str, list[SignalBoard]]:
    store = dist.HashStore()
    name = f"test-{uuid.uuid4().hex[:8]}"
    # the last rank sends, as a trainer's rank does
    made = [
        SignalBoard(store, rank=r, world_size=world_size, name=name, sender=r == world_size - 1)
        for r in range(world_size)
    ]
    OPENED.extend(made)
    return name, made


def files(name: str) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"rewardplane-{name}-board-*"))


def test_a_flag_is_seen_by_every_peer_only_for_its_own_reduction() -> None:
    _, (a, b, c) = boards(3)
    assert b.flag(0, 0) is None  # not written yet
    a.write_flag(0, 1, note=False)
    assert b.flag(0, 0) == (1, False) and c.flag(0, 0) == (1, False)
    assert b.flag(0, 1) is None  # reduction 1 is another round
    a.write_flag(1, FLAG_VALUE_LIMIT - 1, note=True)
    assert c.flag(0, 1) == (FLAG_VALUE_LIMIT - 1, True)
    a.write_flag(FLAG_RING, 0, note=False)  # the ring's slot of reduction 0, reused
    assert b.flag(0, 0) is None and b.flag(0, FLAG_RING) == (0, False)


def test_acknowledgements_count_per_sender() -> None:
    _, (receiver, sender, other) = boards(3)  # any rank may read any counter
    receiver.add_acks(1, 2)
    receiver.add_acks(1, 3)
    receiver.add_acks(2, 1)
    assert sender.acks(0, 1) == 5 and other.acks(0, 2) == 1 and sender.acks(0, 2) == 1


def test_a_board_file_is_gone_once_every_peer_mapped_it() -> None:
    name, (a, b, c) = boards(3)
    assert len(files(name)) == 3
    b.open_peers()
    assert len(files(name)) == 3  # a's and c's are still to be mapped by each other
    a.open_peers()
    c.open_peers()
    assert files(name) == []
    a.write_flag(0, 1, note=False)  # the mappings outlive the files
    assert c.flag(0, 0) == (1, False)
    for board in (a, b, c):
        board.close()


def test_closing_removes_a_board_nobody_mapped() -> None:
    name, group = boards(2)
    for board in group:
        board.close()
    assert files(name) == []


def test_a_senders_message_is_read_once_posted_and_a_long_one_says_it_is_in_the_store() -> None:
    _, (receiver, sender) = boards(2)
    assert receiver.message(1, 0) == (False, None)
    sender.post_message(0, b'[["1.1", [], 0, 256]]')
    assert receiver.message(1, 0) == (True, b'[["1.1", [], 0, 256]]')
    sender.post_message(1, None)
    assert receiver.message(1, 1) == (True, None)
    sender.post_message(MESSAGE_RING, b"x" * MESSAGE_BODY_LIMIT)  # slot 0 again, a full one
    assert receiver.message(1, 0) == (False, None)
    assert receiver.message(1, MESSAGE_RING) == (True, b"x" * MESSAGE_BODY_LIMIT)
    with pytest.raises(ValueError, match="does not fit"):
        sender.post_message(2, b"x" * (MESSAGE_BODY_LIMIT + 1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_reads_every_other_ranks_flag(world_size: int) -> None:
    _, group = boards(world_size)
    for r, board in enumerate(group):
        board.write_flag(0, r % 2, note=False)
    for board in group:
        assert [board.flag(r, 0) for r in range(world_size)] == [(r % 2, False) for r in range(world_size)]
