"""The leader's final step reaches every trainer rank before the leader's store goes
(``StepChannel``): a rank slow to read ``done`` still returns the committed push instead of taking
the closed store for a lost leader. A real TCPStore, hosted here; the follower on a thread."""

from __future__ import annotations

import gc
import threading
import time

import torch.distributed as dist

from rewardplane.sdk.push.ranks.trainer import SenderStep, StepChannel
from rewardplane.testing.servers import free_port
from rewardplane.transport.comm import create_store


def _stores() -> tuple[dist.TCPStore, dist.TCPStore]:
    port = free_port()
    host = create_store("127.0.0.1", port, is_master=True, world_size=None, timeout_s=30)
    return host, create_store("127.0.0.1", port, is_master=False, world_size=None, timeout_s=30)


def test_a_slow_follower_hears_done_before_the_leader_closes_its_store() -> None:
    host, client = _stores()
    leader, follower = StepChannel(host, 0, 30), StepChannel(client, 0, 30)
    heard: list[object] = []

    def follow() -> None:
        time.sleep(0.5)  # busy elsewhere when the leader ends the push
        try:
            heard.append(follower.hear().step)
        except Exception as exc:
            heard.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    leader.tell(SenderStep(push=0, step="done", version=3))
    leader.wait_heard(1)
    del leader, host  # the leader's store goes, as at WeightPusher.close
    gc.collect()
    thread.join(30)
    assert heard == ["done"], heard


def test_after_fail_the_leader_waits_for_no_one() -> None:
    host, _client = _stores()
    leader = StepChannel(host, 0, 30)
    leader.tell(SenderStep(push=0, step="fail", version=3, error="a rank died"))
    start = time.monotonic()
    leader.wait_heard(1)  # the other rank may be dead: nobody hears it
    assert time.monotonic() - start < 1.0
