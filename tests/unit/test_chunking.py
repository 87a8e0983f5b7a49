"""Deterministic contiguous chunking (pure, no sockets)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewardplane.sdk import RewardClient
from rewardplane.sdk.chunking import (
    assignments,
    chunk_size,
    contiguous_chunks,
    reassemble,
    split,
    split_range,
)

sizes = st.integers(min_value=0, max_value=2000)
server_counts = st.integers(min_value=1, max_value=64)


def test_seed_examples() -> None:
    # N=10, S=4 → chunk_size 3: [0,3) [3,6) [6,9) [9,10)
    assert contiguous_chunks(10, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]
    # N=5, S=4 → chunk_size 2: the last server's chunk is empty and gets no request
    assert contiguous_chunks(5, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 5)]
    assert assignments(5, 4) == [(0, range(0, 2)), (1, range(2, 4)), (2, range(4, 5))]
    # 100 texts over 3 servers: 34, 34, 32
    assert [len(r) for r in contiguous_chunks(100, 3)] == [34, 34, 32]


def test_fewer_items_than_servers_leaves_servers_idle() -> None:
    # N=2, S=5 → chunk_size 1: servers 0 and 1 get one item each, the rest nothing.
    assert assignments(2, 5) == [(0, range(0, 1)), (1, range(1, 2))]


def test_zero_items_means_no_request() -> None:
    assert chunk_size(0, 3) == 0
    assert assignments(0, 3) == []
    assert all(len(r) == 0 for r in contiguous_chunks(0, 3))
    assert split([], 3) == [[], [], []]


@pytest.mark.parametrize(("n", "servers"), [(-1, 1), (1, 0), (0, -2)])
def test_invalid_arguments(n: int, servers: int) -> None:
    with pytest.raises(ValueError):
        contiguous_chunks(n, servers)


@given(sizes, server_counts)
def test_chunks_tile_the_batch_in_order(n: int, servers: int) -> None:
    chunks = contiguous_chunks(n, servers)
    assert len(chunks) == servers
    flat = [i for r in chunks for i in r]
    assert flat == list(range(n))  # concatenation is the original order, no gaps, no overlap
    cs = math.ceil(n / servers) if n else 0
    for i, r in enumerate(chunks):
        assert r.start == min(i * cs, n) and r.stop == min((i + 1) * cs, n)
        assert len(r) <= cs


@given(sizes, server_counts)
def test_split_is_stable(n: int, servers: int) -> None:
    # Same N and S → the same chunks on the same server indices, every time.
    assert contiguous_chunks(n, servers) == contiguous_chunks(n, servers)
    assert assignments(n, servers) == assignments(n, servers)
    # Non-empty chunks are a prefix of the server list: empty ones only at the end.
    nonempty = [i for i, _ in assignments(n, servers)]
    assert nonempty == list(range(len(nonempty)))


@given(st.lists(st.text(max_size=5), max_size=300), server_counts)
def test_split_then_reassemble_is_identity(items: list[str], servers: int) -> None:
    parts = split(items, servers)
    assert [x for part in parts for x in part] == items
    chunks = contiguous_chunks(len(items), servers)
    # Outputs may arrive in any order (concurrent requests): reassemble by range, not arrival.
    pairs = list(zip(chunks, parts, strict=True))[::-1]
    assert reassemble([c for c, _ in pairs], [p for _, p in pairs], len(items)) == items


@given(st.integers(min_value=0, max_value=500), st.integers(min_value=0, max_value=50), st.integers(1, 40))
def test_split_range_pieces(start: int, length: int, max_size: int) -> None:
    r = range(start, start + length)
    pieces = split_range(r, max_size)
    assert [i for p in pieces for i in p] == list(r)
    assert all(1 <= len(p) <= max_size for p in pieces)


def test_split_range_rejects_bad_size() -> None:
    with pytest.raises(ValueError):
        split_range(range(3), 0)


def test_reassemble_rejects_misaligned_outputs() -> None:
    with pytest.raises(ValueError, match="expected 2 outputs, got 1"):
        reassemble([range(0, 2), range(2, 3)], [["a"], ["c"]])
    with pytest.raises(ValueError, match="covered by no chunk"):
        reassemble([range(0, 1)], [["a"]], 2)
    with pytest.raises(ValueError, match="more than one chunk"):
        reassemble([range(0, 2), range(1, 2)], [["a", "b"], ["c"]], 2)
    with pytest.raises(ValueError, match="outside"):
        reassemble([range(0, 3)], [["a", "b", "c"]], 2)
    with pytest.raises(ValueError, match="chunks but"):
        reassemble([range(0, 1)], [], 1)


def test_client_request_plan() -> None:
    # The client's routing, without sockets (a client opens no connection when it is made).
    urls = ["http://127.0.0.1:8001", "http://127.0.0.2:8001", "http://127.0.0.3:8001"]
    client = RewardClient(urls, min_chunk=8)
    try:
        assert client._plan(0) == []
        # Small calls: whole, to one server, round robin.
        assert [client._plan(5) for _ in range(4)] == [
            [(0, range(5))],
            [(1, range(5))],
            [(2, range(5))],
            [(0, range(5))],
        ]
        # Large batches: seed-004 chunks, server i gets chunk i, independent of the round robin.
        assert client._plan(100) == [(0, range(0, 34)), (1, range(34, 68)), (2, range(68, 100))]
        assert client._plan(10) == [(0, range(0, 4)), (1, range(4, 8)), (2, range(8, 10))]
        # A per-request cap cuts each server's chunk further, keeping order and server.
        client.max_items_per_request = 16
        assert client._plan(100) == [
            (0, range(0, 16)),
            (0, range(16, 32)),
            (0, range(32, 34)),
            (1, range(34, 50)),
            (1, range(50, 66)),
            (1, range(66, 68)),
            (2, range(68, 84)),
            (2, range(84, 100)),
        ]
    finally:
        client.close()
