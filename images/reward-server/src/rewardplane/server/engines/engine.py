"""What the server needs of an engine: scoring (``RewardEngine``) and, for weight sync, a narrow
port (``WeightSyncPort``). The control plane is built once from the port (``app.build_app``);
engines never build or know it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rewardplane.protocol import ModelKind, ModelTask, ParamMeta, PoolingType, ProcessRewardConfig
from rewardplane.protocol.compat import FinishReason
from rewardplane.server.locking import WeightsGuard


@dataclass(frozen=True)
class EngineInfo:
    served_model_name: str
    engine: str
    num_labels: int
    dtype: str
    head_dtype: str
    max_model_len: int
    vocab_size: int
    pooling_types: tuple[PoolingType, ...]
    id2label: dict[int, str] = field(default_factory=dict)
    world_size: int = 1
    # 0: adapter-only pushes are refused; else the largest LoRA rank served (--enable-lora)
    max_lora_rank: int = 0
    task: ModelTask = ModelTask.SCORE
    kind: ModelKind = ModelKind.SEQUENCE
    # a process reward model's step marking and aggregation, and its step tag's token id
    process: ProcessRewardConfig | None = None
    step_tag_id: int | None = None


@dataclass(frozen=True)
class ServedAdapter:
    """The LoRA adapter scoring uses: a fresh id per pushed version (an engine's adapter cache then
    never serves an older one under a reused id), and where the first worker wrote it (vLLM reloads
    an evicted adapter from there)."""

    adapter_id: int
    path: str | None

    @property
    def name(self) -> str:
        return f"rp-adapter-{self.adapter_id}"


@dataclass(frozen=True)
class SamplingOptions:
    """How one chat is answered (OpenAI's sampling fields, resolved: ``max_tokens`` is set)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # no end of sequence before this many tokens
    ignore_eos: bool = False  # go on to max_tokens past an end of sequence

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Completion:
    """One generated answer: its text (cut before a stop string), how many tokens were generated
    and why generation ended (``stop``: end of sequence or a stop string; ``length``: max_tokens)."""

    text: str
    num_tokens: int
    finish_reason: FinishReason


class WeightSyncPort(Protocol):
    """How the control plane reaches the weights: the worker extension's methods
    (``worker_extension.RewardWeightSyncExtension``) on every worker, called through
    ``weight_sync.worker_calls.WorkerCalls``; the engine's cache; and the served parameters.

    ``call_workers`` must not share threads with scoring: a join that waits out its rendezvous
    timeout must not delay a single forward (the transformers engine runs these calls on threads
    of their own; vLLM's ``collective_rpc`` runs them in its engine processes)."""

    def manifest(self) -> dict[str, ParamMeta]:
        """Every pushable parameter (name, served dtype, shape), checked before a byte is received."""
        ...

    async def call_workers(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` of the worker extension on every worker that holds weights; one result each."""
        ...

    async def reset_cache(self) -> None:
        """Drop whatever the engine computed with the old weights (vLLM: its prefix cache, by advancing
        the cache salt's epoch, ``prefix_cache``)."""
        ...

    def use_adapter(self, adapter: ServedAdapter | None) -> None:
        """Score with ``adapter`` from now on (None: the base weights alone). Called under the
        exclusive weights lock, after every worker loaded it."""
        ...


class RewardEngine(Protocol):
    info: EngineInfo
    guard: WeightsGuard
    tokenizer: Any
    # The folder whose safetensors hold the base weights, reloaded after a level-2 sleep; None when
    # the base weights cannot be read again (random ``--load-format dummy`` weights).
    base_checkpoint: str | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def score(self, prompts: list[list[int]], pooling: PoolingType) -> tuple[list[list[float]], int]:
        """Raw head outputs (one row of ``num_labels`` per prompt) and the weights version that made
        them. All rows of one call come from one version."""
        ...

    async def score_steps(
        self, prompts: list[list[int]], tags: list[list[int]], *, reuse_prefix: bool = False
    ) -> tuple[list[list[list[float]]], int]:
        """A process reward model's raw head rows at the step-tag positions ``tags`` of each prompt
        (one row of ``num_labels`` per tag), and the weights version that made all of them.
        ``reuse_prefix``: only later steps are asked for, so an engine with a prefix cache may start
        from the cached blocks of the earlier ones."""
        ...

    def sleep_problem(self) -> str | None:
        """Why this engine cannot sleep, with what to do (None: it can)."""
        ...

    async def sleep(self, level: int) -> int | None:
        """Release the device memory of the weights (level 1: keep them in host memory; level 2:
        discard them) and of any cache. Called under the exclusive weights lock, so nothing is
        scored meanwhile. Returns the device bytes freed as the engine measures them (None: unknown)."""
        ...

    async def wake(self, level: int) -> None:
        """Take the device memory back. After level 1 the weights are those from before the sleep;
        after level 2 their contents are undefined until reloaded (``sleep.SleepService`` does)."""
        ...

    async def generate(self, prompt: list[int], options: SamplingOptions) -> tuple[list[Completion], int]:
        """``options.n`` answers to one token-id prompt and the weights version that made them
        (engines of task ``generate``; the others are never called: ``ScoringService`` checks)."""
        ...

    def weight_port(self) -> WeightSyncPort:
        """The port the control plane drives (called once, before the server starts)."""
        ...
