"""Where each rank of a push group runs, and which transport that calls for.

Every rank publishes its ``Place`` (host identity, GPU, process) in the group's store before the
group forms; ``choose_transport`` is the pure decision every rank then takes alike: two ranks on
one GPU cannot share an NCCL communicator, so they use the same-host transport (CUDA IPC on a GPU,
shared memory on CPU, ``same_host``), which in turn needs every rank on one host.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from .comm import Backend
from .same_host_memory import WIRE_VERSION

Transport = Literal["nccl", "gloo", "ipc"]

# What a user sets so that containers of two Pods can open each other's CUDA IPC handles and
# shared memory: named in every error about it.
POD_FIELD_HINT = (
    "the trainer and the reward server must share an IPC namespace: set `hostIPC: true` on both Pods "
    "(RewardModel spec.transport.hostIPC), or run the trainer and the reward server as containers of "
    "one Pod"
)


class PlacementError(RuntimeError):
    """The requested transport cannot connect these ranks; the message says which one can."""


@dataclass(frozen=True)
class Place:
    """One rank's host, GPU and process, as every other rank of the group sees them."""

    host: str  # boot id and IPC namespace: equal only where memory can be shared
    name: str  # the host name, for messages (two Pods with hostIPC on one node differ in it)
    gpu: str | None  # the GPU's UUID; None on CPU
    pid: int
    pid_ns: int  # another rank's pid means something here only within one pid namespace
    # The transport this rank was asked for. One rank's request holds for the whole group: a
    # trainer asking for ``ipc`` through the operator meets replicas that were asked for nothing.
    asked: str = "auto"
    # The same-host transport's message version this rank speaks (a peer from before it had one: 1).
    ipc_wire: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Place:
        fields = json.loads(raw)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in fields.items() if k in known})  # a newer peer's extra facts


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def host_identity() -> str:
    """Equal for two processes exactly when they can share memory: one boot of one machine (the
    boot id) and one IPC namespace (containers of one Pod, or Pods with ``hostIPC``)."""
    return f"{_read('/proc/sys/kernel/random/boot_id')}/ipc:{_ns_inode('ipc')}"


def local_place(device: torch.device, asked: Backend = "auto") -> Place:
    gpu = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = str(torch.cuda.get_device_properties(index).uuid)
    return Place(
        host=host_identity(),
        name=socket.gethostname(),
        gpu=gpu,
        pid=os.getpid(),
        pid_ns=_ns_inode("pid"),
        asked=asked,
        ipc_wire=WIRE_VERSION,
    )


def _shared_gpus(places: list[Place]) -> list[tuple[int, int, str]]:
    """(rank, rank, GPU) for every rank on a GPU an earlier rank already uses."""
    first: dict[str, int] = {}
    out = []
    for rank, p in enumerate(places):
        if p.gpu is None:
            continue
        if p.gpu in first:
            out.append((first[p.gpu], rank, p.gpu))
        else:
            first[p.gpu] = rank
    return out


def group_request(requested: Backend, places: list[Place]) -> Backend:
    """The transport the group was asked for: the one any rank (``places[r].asked``, or this
    rank's ``requested``) names, ``auto`` where none does; ranks naming different ones are refused,
    since each would build another transport and wait for the others until its timeout."""
    asked = {r: p.asked for r, p in enumerate(places) if p.asked != "auto"}
    named = set(asked.values()) | ({requested} - {"auto"})
    if len(named) > 1:
        by_rank = ", ".join(f"rank {r}: {b}" for r, b in sorted(asked.items()))
        raise PlacementError(
            f"the ranks of the group ask for different transports ({by_rank}; this rank: {requested}); "
            "ask every rank for the same backend, or leave all but one on auto"
        )
    return named.pop() if named else "auto"  # type: ignore[return-value]


def choose_transport(requested: Backend, places: list[Place]) -> Transport:
    """The transport for a group of ``places`` (by rank), or a ``PlacementError`` saying which
    transport fits. The request is the group's (``group_request``). ``auto``: the same-host
    transport where ranks share a GPU (NCCL cannot), NCCL between GPUs, gloo on CPU (explicit
    ``ipc`` gives shared memory on one CPU host)."""
    requested = group_request(requested, places)
    on_gpu = all(p.gpu is not None for p in places)
    hosts = sorted({p.host for p in places})
    shared = _shared_gpus(places) if on_gpu else []
    if requested == "ipc":
        if len(hosts) > 1:
            raise PlacementError(
                "backend ipc (the same-host transport) needs every rank of the group on one host and in one "
                f"IPC namespace, but they are in {len(hosts)} ({_where(places)}); use backend nccl (or auto) "
                f"between nodes. If they are on one node, {POD_FIELD_HINT}"
            )
        return _same_wire(places)
    if requested == "nccl":
        if not on_gpu:
            raise PlacementError(
                "backend nccl needs a CUDA device on every rank; use backend gloo (or auto) on CPU"
            )
        if shared:
            _refuse_split(places, shared[0])
            a, b, gpu = shared[0]
            raise PlacementError(
                f"ranks {a} and {b} of the group are on one GPU ({gpu}): NCCL refuses two ranks of one "
                "communicator on one GPU. Use backend ipc (the same-GPU transport, CUDA IPC), or auto, "
                "which picks it"
            )
        return "nccl"
    if requested == "gloo":
        return "gloo"
    if shared:
        _refuse_split(places, shared[0])
        return _same_wire(places)
    return "nccl" if on_gpu else "gloo"


def _same_wire(places: list[Place]) -> Transport:
    """``ipc``, where every rank speaks the same version of its messages: ranks that do not would
    each wait for store keys the other never writes."""
    wires = {r: p.ipc_wire for r, p in enumerate(places)}
    if len(set(wires.values())) > 1:
        by_rank = ", ".join(f"rank {r}: {w}" for r, w in sorted(wires.items()))
        raise PlacementError(
            f"the ranks speak different versions of the same-host transport ({by_rank}): install the "
            "same rewardplane version on the trainer and in the reward server image"
        )
    return "ipc"


def _where(places: list[Place]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, p in enumerate(places):
        groups.setdefault(p.host, []).append(rank)
    return "; ".join(f"ranks {ranks} on {places[ranks[0]].name}" for ranks in groups.values())


def _refuse_split(places: list[Place], pair: tuple[int, int, str]) -> None:
    """Two ranks on one GPU but in two IPC namespaces: neither NCCL nor CUDA IPC can join them."""
    a, b, gpu = pair
    if places[a].host != places[b].host:
        raise PlacementError(
            f"ranks {a} and {b} are on one GPU ({gpu}) but in two IPC namespaces ({places[a].name}, "
            f"{places[b].name}): NCCL refuses two ranks on one GPU and CUDA IPC cannot open handles "
            f"across IPC namespaces. {POD_FIELD_HINT}"
        )
