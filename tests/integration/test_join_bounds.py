"""Joins of a trainer's group are bounded, over real HTTP against real server processes: a join to a
store nobody serves, or to a peer that accepts and never answers (a frozen trainer), is given up
after its timeout_s and the next join works; timeout_s above the server's maximum is refused; a
pending join is cancelled by POST /close_communicator, which names it (a close naming another group
leaves it pending), and a fresh push then works."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.sdk.push.pusher import WeightPusher
from rewardplane.testing.servers import ServerHandle, free_port
from tests.fixtures.trainer import perturbed

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JOIN_TIMEOUT_S = 3.0
SLACK_S = 10.0  # JOIN_GRACE_S (5 s) plus polling and a loaded CI machine


@pytest.fixture
def server(server_factory: Any, tiny_model_dir: Any) -> ServerHandle:
    handle: ServerHandle = server_factory(tiny_model_dir, token=TOKEN)
    return handle


@pytest.fixture
def silent_peer() -> Iterator[int]:
    """A TCP listener that accepts every connection and never says a word (a frozen trainer)."""
    sock = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for conn in held:
        conn.close()
    sock.close()


def _join(server: ServerHandle, port: int, timeout_s: float) -> httpx.Response:
    body = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": timeout_s}
    return httpx.post(f"{server.url}/init_communicator", json=body, headers=AUTH, timeout=30)


def _wait_join_outcome(server: ServerHandle, within_s: float) -> tuple[str, float]:
    """The join's error once no background task runs (the join is over), and how long that took."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
        if tasks["num_background_tasks"] == 0:
            return str(tasks["last_error"]), time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"the join was still pending {within_s:.0f}s later")


def _push_works(server: ServerHandle, tiny_model_dir: Any, version: int) -> None:
    sync = WeightPusher(
        [server.url], group_port=free_port(), token=TOKEN, trainer_host="127.0.0.1", connect_timeout_s=30
    )
    try:
        model = perturbed(tiny_model_dir, seed=version)
        assert sync.push(model.state_dict(), version=version, training_mode=Mode.FULL) == version
    finally:
        sync.close()
    assert httpx.get(f"{server.url}/runtime_version", timeout=10).json()["version"] == version


def test_join_to_a_store_nobody_serves_is_given_up_then_a_push_works(
    server: ServerHandle, tiny_model_dir: Any
) -> None:
    dead = free_port()
    assert _join(server, dead, JOIN_TIMEOUT_S).status_code == 200
    error, took = _wait_join_outcome(server, JOIN_TIMEOUT_S + SLACK_S)
    assert f"127.0.0.1:{dead}" in error, error
    assert took < JOIN_TIMEOUT_S + SLACK_S
    _push_works(server, tiny_model_dir, version=1)


def test_an_announce_whose_trainer_never_joined_is_refused_as_such(
    server: ServerHandle, tiny_model_dir: Any
) -> None:
    """The operator tells "no trainer came" from a refusing replica by the refusal's code."""
    from rewardplane.protocol import TRAINER_ABSENT, Endpoints

    assert _join(server, free_port(), JOIN_TIMEOUT_S).status_code == 200
    manifest = httpx.get(f"{server.url}{Endpoints.PARAM_MANIFEST}", headers=AUTH, timeout=30).json()
    head = [m for m in manifest if m["name"].startswith("score.")]
    r = httpx.post(
        f"{server.url}{Endpoints.UPDATE_PARAM_BATCH}",
        json={"metadata": head, "training_mode": "head_only", "version": 1, "timeout_s": 1.0},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 409 and r.json()["detail"] == {"code": TRAINER_ABSENT}, r.text
    assert "still forming" in r.json()["error"]
    _wait_join_outcome(server, JOIN_TIMEOUT_S + SLACK_S)
    _push_works(server, tiny_model_dir, version=1)


def test_join_to_a_peer_that_never_answers_is_given_up_then_a_new_join_is_taken(
    server: ServerHandle, tiny_model_dir: Any, silent_peer: int
) -> None:
    assert _join(server, silent_peer, JOIN_TIMEOUT_S).status_code == 200
    assert _join(server, silent_peer, JOIN_TIMEOUT_S).status_code == 409  # one join at a time
    error, _ = _wait_join_outcome(server, JOIN_TIMEOUT_S + SLACK_S)
    assert f"did not form within timeout_s={JOIN_TIMEOUT_S:g}s" in error, error
    # the worker thread may still be blocked on the silent peer: the next join does not wait for it
    _push_works(server, tiny_model_dir, version=1)


def test_timeout_above_the_server_maximum_is_refused(server_factory: Any, tiny_model_dir: Any) -> None:
    server = server_factory(tiny_model_dir, token=TOKEN, max_join_timeout_s=30)
    for timeout_s in (31, 1e6):
        r = _join(server, free_port(), timeout_s)
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert "maximum of 30s" in message and "--max-join-timeout-s" in message, message
    tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
    assert tasks["num_background_tasks"] == 0  # nothing was started


def test_default_maximum_is_600_seconds(server: ServerHandle) -> None:
    r = _join(server, free_port(), 1e6)
    assert r.status_code == 400 and "maximum of 600s" in r.json()["error"], r.text


def test_close_cancels_a_pending_join_then_a_push_works(
    server: ServerHandle, tiny_model_dir: Any, silent_peer: int
) -> None:
    assert _join(server, silent_peer, 300).status_code == 200
    time.sleep(0.5)
    start = time.monotonic()
    r = httpx.post(f"{server.url}/close_communicator", headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    cancelled = r.json()["cancelled_join"]
    assert cancelled["host"] == "127.0.0.1" and cancelled["port"] == silent_peer, cancelled
    assert cancelled["pending_s"] > 0 and cancelled["group_id"]
    assert time.monotonic() - start < SLACK_S
    tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
    assert tasks["num_background_tasks"] == 0
    # nothing pending any more: a close answers without a cancelled join
    again = httpx.post(f"{server.url}/close_communicator", headers=AUTH, timeout=30).json()
    assert again["cancelled_join"] is None
    _push_works(server, tiny_model_dir, version=1)


def test_a_close_naming_a_group_cancels_that_groups_join_only(
    server: ServerHandle, tiny_model_dir: Any, silent_peer: int
) -> None:
    """What an operator that took over a push does with the joins its predecessor asked for: a
    close naming another group changes nothing (closed false, the join still pending); one naming
    the pending join's group cancels it, and a push then works."""
    body = {
        "host": "127.0.0.1",
        "port": silent_peer,
        "world_size": 2,
        "timeout_s": 300,
        "group_id": "push-g1",
    }
    assert (
        httpx.post(f"{server.url}/init_communicator", json=body, headers=AUTH, timeout=30).status_code == 200
    )

    def close(group_id: str) -> dict[str, Any]:
        r = httpx.post(
            f"{server.url}/close_communicator", json={"group_id": group_id}, headers=AUTH, timeout=60
        )
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()
        return answer

    assert close("push-g0") == {"status": "ok", "closed": False, "cancelled_join": None}
    bad = httpx.post(f"{server.url}/close_communicator", json={"group_id": 5}, headers=AUTH, timeout=30)
    assert bad.status_code == 422 and "group_id" in bad.text, bad.text  # refused, nothing closed
    tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
    assert tasks["num_background_tasks"] == 1  # the join of push-g1 still waits
    assert _join(server, silent_peer, 300).status_code == 409
    answer = close("push-g1")
    assert answer["closed"] is True and answer["cancelled_join"]["group_id"] == "push-g1", answer
    tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
    assert tasks["num_background_tasks"] == 0
    assert close("push-g1")["closed"] is False  # nothing of that group is left
    _push_works(server, tiny_model_dir, version=1)
