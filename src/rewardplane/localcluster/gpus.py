"""The node agent's GPUs: which pod holds which device, and when a pod on a shared device may start.

Pure logic (no I/O, no threads; the agent calls it under its lock). Two ways a pod gets GPUs:

- **exclusive**: the pod requests ``nvidia.com/gpu: n`` and the agent hands it ``n`` whole devices
  (the device plugin's job on a real node), preferring devices no other pod uses;
- **shared** (the operator's ``gpu.mode: shared``): the pod requests no ``nvidia.com/gpu`` and pins
  its devices itself with ``CUDA_VISIBLE_DEVICES``; several such pods may pin one device, each
  limited by its own memory fraction (vLLM's ``--gpu-memory-utilization``).

Device ids are the node's physical indices 0..n-1 in PCI bus order (the agent sets
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for every GPU pod, so they match ``nvidia-smi``).

Why shared pods start one at a time: vLLM (0.24, ``vllm/v1/worker/gpu_worker.py``) takes a
snapshot of the *device's* free memory when its worker starts, refuses to start unless
``fraction × total`` is free (``vllm/v1/worker/utils.py:request_memory``), and then sizes its KV
cache as ``fraction × total`` minus everything the device gained since the snapshot
(``vllm/utils/mem_utils.py``: ``non_torch_memory`` is device-wide). A neighbour that allocates
while it profiles is counted against its budget (a smaller or negative KV cache), and one that
frees memory meanwhile trips its assertion "Error in memory profiling". So a pod that pins a
device waits until no other pod pinning that device is still starting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rewardplane.localcluster.podspec import PodConfigError

VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def pinned_devices(env: Mapping[str, str], requested: int, node_gpus: int) -> tuple[int, ...]:
    """The devices a pod pins itself (shared mode): ``CUDA_VISIBLE_DEVICES`` of its own env when it
    requests no ``nvidia.com/gpu``. Empty when it requests GPUs (the agent picks them) or sets none.
    Raises PodConfigError for ids the agent cannot track or the node does not have."""
    raw = env.get(VISIBLE_DEVICES_ENV)
    if requested or raw is None or not raw.strip():
        return ()
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts):
        raise PodConfigError(
            f"{VISIBLE_DEVICES_ENV}={raw!r}: the node agent tracks devices by index; "
            "list device indices like 0 or 0,1 (not UUIDs)"
        )
    ids = tuple(int(p) for p in parts)
    if len(set(ids)) != len(ids):
        raise PodConfigError(f"{VISIBLE_DEVICES_ENV}={raw!r} lists a device twice")
    missing = [d for d in ids if d >= node_gpus]
    if missing:
        raise PodConfigError(
            f"{VISIBLE_DEVICES_ENV}={raw!r} pins device(s) {missing}, but this node has {node_gpus} "
            f"GPU(s) (ids 0..{node_gpus - 1}); start the agent with more --gpus or pin other devices"
        )
    return ids


@dataclass
class _Holder:
    name: str  # namespace/pod, for messages
    devices: tuple[int, ...]
    exclusive: bool
    starting: bool = False


@dataclass
class GpuInventory:
    """Who holds which of the node's ``count`` devices (keyed by pod UID)."""

    count: int
    _holders: dict[str, _Holder] = field(default_factory=dict)

    def _users(self, device: int, *, but: str) -> list[tuple[str, _Holder]]:
        return [(o, h) for o, h in self._holders.items() if o != but and device in h.devices]

    def claim_exclusive(self, owner: str, name: str, n: int) -> tuple[int, ...]:
        """``n`` whole devices for ``owner`` (the same ones again if it holds some already): devices
        no other pod holds or pins. Raises PodConfigError naming who holds the rest."""
        held = self._holders.get(owner)
        if held is not None and held.exclusive:
            return held.devices
        free = [d for d in range(self.count) if not self._users(d, but=owner)]
        if n > len(free):
            busy = sorted({h.name for o, h in self._holders.items() if o != owner})
            raise PodConfigError(
                f"pod requests {n} nvidia.com/gpu but only {len(free)} of this node's {self.count} "
                f"are free (in use by {', '.join(busy) or 'nobody'}); start the agent with more "
                "--gpus or delete pods"
            )
        self._holders[owner] = _Holder(name, tuple(free[:n]), exclusive=True)
        return self._holders[owner].devices

    def pin(self, owner: str, name: str, devices: tuple[int, ...]) -> None:
        """Record a shared-mode pod's own devices. Raises PodConfigError when another pod holds one
        of them exclusively (the agent retries: that pod may go away)."""
        for d in devices:
            taken = [h.name for _, h in self._users(d, but=owner) if h.exclusive]
            if taken:
                raise PodConfigError(
                    f"device {d} is held exclusively by pod {taken[0]}; waiting for it to be released "
                    "(or pin another device with spec.gpu.deviceIds)"
                )
        prev = self._holders.get(owner)
        self._holders[owner] = _Holder(name, devices, exclusive=False, starting=bool(prev and prev.starting))

    def start_blocker(self, owner: str) -> str | None:
        """Why ``owner`` (a pinning pod) must not start its process yet, or None: another pod that
        pins one of its devices is still starting (see the module's docstring)."""
        me = self._holders.get(owner)
        if me is None or me.exclusive:
            return None
        for d in me.devices:
            for _, other in self._users(d, but=owner):
                if other.starting and not other.exclusive:
                    return (
                        f"waiting for pod {other.name} on GPU {d} to finish starting: vLLM measures the "
                        "device's free memory while it starts, so pods sharing a GPU start one at a time"
                    )
        return None

    def begin_start(self, owner: str, *, mark: bool) -> str | None:
        """Check and mark in one step (two pods' workers must not both slip through): the reason
        ``owner`` must wait, or None after marking it starting (when ``mark``: it has a probe that
        will say when its start-up is over)."""
        blocker = self.start_blocker(owner)
        if blocker is None and mark:
            self.set_starting(owner, True)
        return blocker

    def set_starting(self, owner: str, starting: bool) -> None:
        """A pod's process started (True) or is past its start-up: probe passed, or it exited (False)."""
        held = self._holders.get(owner)
        if held is not None:
            held.starting = starting

    def devices_of(self, owner: str) -> tuple[int, ...]:
        held = self._holders.get(owner)
        return held.devices if held is not None else ()

    def release(self, owner: str) -> None:
        self._holders.pop(owner, None)
