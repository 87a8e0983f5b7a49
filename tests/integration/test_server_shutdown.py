"""SIGTERM ends a real server process with exit status 0 within its grace period, whatever its
control plane holds: a join waiting on a store that accepts and never answers, a trainer group
that never forms, a push just refused, a pusher still open."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification

from rewardplane.sdk import RewardModelTrainingMode, RewardServerError, WeightPusher, select_head
from rewardplane.testing.servers import ServerHandle, free_port

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRACE_S = 10.0  # --graceful-shutdown-s's default


def _join(server: ServerHandle, port: int, timeout_s: float = 60) -> None:
    body = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": timeout_s}
    r = httpx.post(f"{server.url}/init_communicator", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text


def _assert_clean_stop(server: ServerHandle) -> None:
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=GRACE_S + 15)
    except Exception:
        pytest.fail(f"still running {GRACE_S + 15:g} s after SIGTERM:\n{server.log()[-4000:]}")
    took = time.monotonic() - start
    assert code == 0, f"exit status {code} after {took:.1f}s:\n{server.log()[-4000:]}"
    assert took < GRACE_S, f"SIGTERM took {took:.1f}s (grace period {GRACE_S:g} s):\n{server.log()[-4000:]}"
    assert "Threads still running" not in server.log()


@pytest.fixture
def silent_store() -> Iterator[int]:
    """A port that accepts connections and never answers (a trainer stopped in a debugger, a
    firewall that swallows packets after the handshake)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def test_sigterm_during_a_join_to_a_store_that_never_answers(server_factory, tiny_model_dir, silent_store):
    server = server_factory(tiny_model_dir, token=TOKEN)
    _join(server, silent_store)
    time.sleep(1.0)  # the workers' store client is connected and waits for an answer
    _assert_clean_stop(server)


def test_sigterm_while_a_join_waits_for_the_trainer_to_join_its_group(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    port = free_port()
    # the trainer's store is up, but the trainer never joins the group (rank 1 never arrives)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )
    _join(server, port)
    time.sleep(1.0)
    _assert_clean_stop(server)
    del store


# A trainer that forms the group with the server, then stops (SIGSTOP: a debugger's breakpoint, a
# frozen node): its store's port still accepts connections, and nothing answers on them.
TRAINER_THAT_FREEZES = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import timedelta
    import httpx, torch
    import torch.distributed as dist
    from rewardplane.transport.group import open_group

    url, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    join = {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 60, "group_id": "frozen"}
    r = httpx.post(url + "/init_communicator", json=join, headers={"Authorization": "Bearer " + token}, timeout=60)
    r.raise_for_status()
    open_group(store, rank=1, world_size=2, device=torch.device("cpu"), timeout_s=60, group_id="frozen")
    print("formed", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    """
)


def test_sigterm_after_the_trainer_froze_right_after_forming_its_group(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_THAT_FREEZES, server.url, str(free_port()), TOKEN],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stderr is not None
        if trainer.stdout.readline().strip() != "formed":
            pytest.fail(f"the trainer did not form its group:\n{trainer.stderr.read()[-4000:]}")
        time.sleep(1.0)  # the server now waits on the frozen trainer's store
        _assert_clean_stop(server)
    finally:
        trainer.kill()
        trainer.wait(timeout=30)


def _pusher(server: ServerHandle) -> WeightPusher:
    return WeightPusher([server.url], group_port=free_port(), token=TOKEN)


def _head(model_dir: Path) -> dict[str, torch.Tensor]:
    return select_head(AutoModelForSequenceClassification.from_pretrained(model_dir).state_dict())


def test_sigterm_after_a_refused_push_with_its_pusher_open(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    head = _head(tiny_model_dir)
    pusher = _pusher(server)
    pusher.push(head, version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY)
    with pytest.raises(RewardServerError, match="not newer"):
        pusher.push(head, version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY)
    _assert_clean_stop(server)  # the pusher is never closed


def test_sigterm_with_two_open_pushers_the_second_refused(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    head = _head(tiny_model_dir)
    first, second = _pusher(server), _pusher(server)
    first.push(head, version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY)
    with pytest.raises(RewardServerError, match="not newer"):
        second.push(head, version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY)
    _assert_clean_stop(server)


def test_sigterm_with_an_open_pusher_listening_for_pushes(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)
    pusher = _pusher(server)
    pusher.push(_head(tiny_model_dir), version=1, training_mode=RewardModelTrainingMode.HEAD_ONLY)
    _assert_clean_stop(server)
