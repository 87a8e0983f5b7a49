"""The node agent's GPU bookkeeping: exclusive pods get devices no shared pod pins, shared pods on one
device start one at a time (vLLM measures the device's free memory while it starts)."""

from __future__ import annotations

import pytest

from rewardplane.localcluster.gpus import GpuInventory, pinned_devices
from rewardplane.localcluster.podspec import PodConfigError


def test_pinned_devices_come_from_the_pods_own_env_only_without_a_gpu_request() -> None:
    assert pinned_devices({"CUDA_VISIBLE_DEVICES": "0"}, 0, 4) == (0,)
    assert pinned_devices({"CUDA_VISIBLE_DEVICES": " 2, 3 "}, 0, 4) == (2, 3)
    assert pinned_devices({}, 0, 4) == ()
    assert pinned_devices({"CUDA_VISIBLE_DEVICES": ""}, 0, 4) == ()  # hides every GPU: pins none
    assert pinned_devices({"CUDA_VISIBLE_DEVICES": "0"}, 1, 4) == ()  # the agent chooses for it


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("GPU-5a1b", "by index"),
        ("0,0", "twice"),
        ("3", "this node has 2 GPU(s) (ids 0..1)"),
    ],
)
def test_pins_the_agent_cannot_honour_are_config_errors(value: str, message: str) -> None:
    with pytest.raises(PodConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pinned_devices({"CUDA_VISIBLE_DEVICES": value}, 0, 2)


def test_exclusive_pods_avoid_devices_that_shared_pods_pin() -> None:
    inv = GpuInventory(3)
    inv.pin("a", "ns/shared-a", (0,))
    inv.pin("b", "ns/shared-b", (0,))  # two shared pods on one device is the point of shared mode
    assert inv.claim_exclusive("c", "ns/excl-c", 1) == (1,)
    assert inv.claim_exclusive("c", "ns/excl-c", 1) == (1,)  # a restart keeps its device
    assert inv.claim_exclusive("d", "ns/excl-d", 1) == (2,)
    with pytest.raises(PodConfigError, match=r"only 0 of this node's 3 are free \(in use by ns/excl-c"):
        inv.claim_exclusive("e", "ns/excl-e", 1)
    inv.release("d")
    assert inv.claim_exclusive("e", "ns/excl-e", 1) == (2,)


def test_a_shared_pod_cannot_pin_a_device_held_exclusively() -> None:
    inv = GpuInventory(2)
    assert inv.claim_exclusive("x", "ns/excl", 1) == (0,)
    with pytest.raises(PodConfigError, match="device 0 is held exclusively by pod ns/excl"):
        inv.pin("s", "ns/shared", (0,))
    inv.release("x")
    inv.pin("s", "ns/shared", (0,))
    assert inv.devices_of("s") == (0,)


def test_shared_pods_on_one_device_start_one_at_a_time() -> None:
    inv = GpuInventory(2)
    inv.pin("a", "ns/a", (0,))
    inv.pin("b", "ns/b", (0,))
    inv.pin("c", "ns/c", (1,))
    assert inv.start_blocker("a") is None
    inv.set_starting("a", True)  # a's process runs, its probe has not passed yet
    blocker = inv.start_blocker("b")
    assert blocker is not None and "ns/a on GPU 0" in blocker and "one at a time" in blocker
    assert inv.start_blocker("c") is None  # another device: no reason to wait
    assert inv.start_blocker("a") is None  # never blocked by itself
    inv.set_starting("a", False)  # a's startup probe passed (or its process exited)
    assert inv.start_blocker("b") is None
    inv.set_starting("b", True)
    inv.release("b")  # b deleted mid-start: nobody waits for it any more
    inv.pin("a", "ns/a", (0,))
    assert inv.start_blocker("a") is None


def test_pinning_again_keeps_the_starting_mark() -> None:
    inv = GpuInventory(1)
    inv.pin("a", "ns/a", (0,))
    inv.pin("b", "ns/b", (0,))
    inv.set_starting("a", True)
    inv.pin("a", "ns/a", (0,))  # the agent re-prepares a pod on every start attempt
    assert inv.start_blocker("b") is not None


def test_begin_start_checks_and_marks_in_one_step() -> None:
    inv = GpuInventory(1)
    inv.pin("a", "ns/a", (0,))
    inv.pin("b", "ns/b", (0,))
    assert inv.begin_start("a", mark=True) is None  # a goes, and is now starting
    assert inv.begin_start("b", mark=True) is not None  # b, right behind it, waits
    inv.set_starting("a", False)
    assert inv.begin_start("b", mark=False) is None  # a pod without probes does not block others
    assert inv.begin_start("a", mark=True) is None
