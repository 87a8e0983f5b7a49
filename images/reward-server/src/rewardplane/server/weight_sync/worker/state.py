"""What the worker's parts share: the engine that holds the weights (``WorkerHost``, one per
engine), the group this worker is in, what a push staged or keeps, and the join attempt that may
install a group.

A join's rendezvous runs on a thread of its own and cannot be interrupted (``join.py``): a thread of
an abandoned attempt that forms its group after all closes it instead of installing it (the
``comm`` setter), so it can never replace the group of a later join."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rewardplane.protocol import AdapterConfig, Bucket, ParamMeta
from rewardplane.protocol.slices import Region
from rewardplane.transport.comm import Communicator

if TYPE_CHECKING:
    from rewardplane.server.weight_sync.persistence import HostCopy

# On a join's thread: the attempt it works for (unset on every other thread).
join_thread = threading.local()
# One lock for every worker of the process: joins are rare.
JOIN_LOCK = threading.Lock()


@dataclass
class PushedAdapter:
    """An adapter push to serve: its LoRA tensors, its shape, the id requests name it by, and the
    update's timeline (monotonic times), to which serving it adds each step's end."""

    tensors: dict[str, torch.Tensor]
    config: AdapterConfig
    adapter_id: int
    times: dict[str, float]


class WorkerHost(Protocol):
    """What the weight-sync parts need of the engine that holds the weights: vLLM's GPU worker
    (``vllm_host.VLLMHost``) or the transformers engine's model (``worker_extension.HFHost``)."""

    def model(self) -> torch.nn.Module: ...

    def device(self) -> torch.device: ...

    def local_rank(self) -> int: ...

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load pushed tensors under their pushed (HF) names, through the engine's own loader."""
        ...

    def parameter_view(self, name: str) -> torch.Tensor | None:
        """The parameter view a pushed tensor of ``name`` lands in whole; None where it does not."""
        ...

    def slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        """What this worker keeps of ``name`` and where; None where only the loader can load it."""
        ...

    def peer_view(self, name: str) -> torch.Tensor | None:
        """The live tensor that holds ``name``'s values under its pushed shape, read in place."""
        ...

    def named_parameters(self) -> dict[str, torch.Tensor] | None:
        """The live parameters under their pushed names, for the base fingerprint; None where they
        are not (vLLM fuses and shards them, and its tensors cannot travel back over its RPC)."""
        ...

    def accepts(self, name: str) -> bool:
        """Whether ``load`` takes a checkpoint tensor of this name."""
        ...

    def forget_places(self) -> None:
        """The parameters were discarded (and are loaded again): where each name lands is void."""
        ...

    def set_adapter(self, adapter: PushedAdapter) -> str | None:
        """Serve ``adapter`` (replacing the current one); where it was written (None: in memory)."""
        ...

    def clear_adapter(self) -> None:
        """Back to the base weights alone."""
        ...


@dataclass
class JoinAttempt:
    id: str
    done: bool = False
    rank: int | None = None
    error: str | None = None
    abandoned: bool = False


class WorkerState:
    """The state more than one part reads or writes."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        self.attempt: JoinAttempt | None = None  # the join started last (join.py)
        self._comm: Communicator | None = None
        # an atomic push received whole, until the swap (or the adapter a push staged)
        self.staged: list[tuple[Bucket, torch.Tensor]] | None = None
        # Persistence (--weights-dir): host copies, under HF names, of what the running update loaded
        # (every worker keeps its own: the whole tensor, or the range a tensor-parallel worker keeps).
        self.kept: dict[str, HostCopy] | None = None
        # set to stop the data-plane listener thread (listener.py)
        self.listen_stop: threading.Event | None = None

    @property
    def comm(self) -> Communicator | None:
        return self._comm

    @comm.setter
    def comm(self, comm: Communicator | None) -> None:
        attempt_id = getattr(join_thread, "attempt", None)
        with JOIN_LOCK:
            current = self.attempt
            stale = attempt_id is not None and (
                current is None or current.id != attempt_id or current.abandoned
            )
            if not stale:
                self._comm = comm
                return
        if comm is not None:  # an abandoned join formed its group late: nobody will use it
            comm.close()

    def stop_listening(self) -> None:
        # The listener thread sees the flag within a second; the control plane also closes the channel.
        if self.listen_stop is not None:
            self.listen_stop.set()
        self.listen_stop = None

    def place(self, meta: ParamMeta) -> torch.Tensor | None:
        """Where a pushed tensor would be received in place (per-tensor wire; ``receive_buckets``
        uses it only where it fits exactly). Never while host copies of the loaded weights are kept
        (they are taken from what the loader sees)."""
        return None if self.kept is not None else self.host.parameter_view(meta.name)
