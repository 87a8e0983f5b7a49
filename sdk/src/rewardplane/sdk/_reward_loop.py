"""The reward loop: user reward functions (sync or async) and reward-model scores, per sample,
concurrently, combined into one reward each.

- Register functions with :meth:`RewardLoop.register`. ``async def`` functions are awaited;
  plain functions run in a thread pool, so a slow rule (a sandboxed unit test, a regex over a
  long answer) does not block the others.
- Every function is called once per sample, with at most ``max_concurrency`` calls in flight.
  A function that declares a ``client`` parameter gets the loop's scoring client (to call a
  reward model itself, e.g. with its own prompt).
- A function returns a float, or a dict with ``"score"`` and any extra information, which is
  kept in :attr:`RewardResult.extra` under the function's name.
- :meth:`RewardLoop.add_reward_model` adds the reward model itself as a component; its
  samples are scored in batches (one request per ``batch_size`` samples), not one by one.
- The reward of a sample is ``Σ weight · score`` over the components.

Fail fast: a function that raises, or returns something that is not a score, stops the run with
:class:`RewardFunctionError` naming the function and the sample; the other calls are cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rewardplane.protocol import Score

from ._aio import gather_or_cancel
from ._credit import Reduction, reduce_score
from ._exceptions import CreditAssignmentError, RewardFunctionError
from ._scorer import AsyncScoringClient, check_async_client


@dataclass
class RewardSample:
    """One sample to reward: the prompt, the policy's response and what a rule may need."""

    prompt: str
    response: str
    ground_truth: Any = None
    data_source: str = "default"
    extra_info: dict[str, Any] = field(default_factory=dict)


def sample_text(sample: RewardSample) -> str:
    """The default text a reward model scores: prompt and response, one after the other."""
    return f"{sample.prompt}\n{sample.response}"


@dataclass(frozen=True)
class RewardResult:
    """The reward of one sample: the combined ``score``, each component's score, and the extra
    information the functions returned (``extra[function name] = {key: value}``)."""

    score: float
    components: dict[str, float]
    extra: dict[str, dict[str, Any]]


RewardValue = float | int | Mapping[str, Any]
RewardFn = Callable[..., RewardValue | Awaitable[RewardValue]]


@dataclass(frozen=True)
class _Registered:
    name: str
    fn: RewardFn
    weight: float
    is_async: bool
    wants_client: bool


@dataclass(frozen=True)
class _RewardModelComponent:
    name: str
    weight: float
    text_fn: Callable[[RewardSample], str]
    batch_size: int
    normalize: bool
    reduce: Reduction | None


def _is_async(fn: Callable[..., Any]) -> bool:
    target = fn.func if isinstance(fn, functools.partial) else fn
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
        getattr(target, "__call__", None)  # noqa: B004 - an object with an async __call__
    )


def _wants_client(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    return any(p.name == "client" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def parse_result(value: Any, *, name: str, index: int) -> tuple[float, dict[str, Any]]:
    """A function's return value as ``(score, extra)``; raises RewardFunctionError otherwise."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise RewardFunctionError(
                f"reward function {name!r} returned a dict without 'score' for sample {index} "
                f"(keys: {sorted(value)[:10]}); return a float or {{'score': float, ...extra}}"
            )
        score, extra = value["score"], {k: v for k, v in value.items() if k != "score"}
    else:
        score, extra = value, {}
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise RewardFunctionError(
            f"reward function {name!r} returned a score of type {type(score).__name__} for sample "
            f"{index}; return a float or {{'score': float, ...extra}}"
        )
    if not math.isfinite(score):
        raise RewardFunctionError(
            f"reward function {name!r} returned a non-finite score ({score}) for sample {index}"
        )
    return float(score), extra


class RewardLoop:
    """Rewards for a batch of samples from registered functions and, optionally, a reward model.

    Args:
        client: the scoring client handed to functions that ask for it (``client`` parameter)
            and used by :meth:`add_reward_model`.
        max_concurrency: reward-function calls in flight at once (sync ones each take a thread).
    """

    def __init__(self, client: AsyncScoringClient | None = None, *, max_concurrency: int = 64) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.client = client
        self.max_concurrency = max_concurrency
        self._functions: list[_Registered] = []
        self._rm: _RewardModelComponent | None = None

    def _check_name(self, name: str) -> None:
        taken = {f.name for f in self._functions} | ({self._rm.name} if self._rm else set())
        if name in taken:
            raise ValueError(f"a reward component named {name!r} is already registered; pass name=")

    def register(self, fn: RewardFn | None = None, *, name: str | None = None, weight: float = 1.0) -> Any:
        """Register ``fn`` (sync or async, detected); usable as ``@loop.register`` or
        ``@loop.register(weight=0.5)``. Returns ``fn``."""

        def add(f: RewardFn) -> RewardFn:
            if not callable(f):
                raise TypeError(f"a reward function must be callable, got {type(f).__name__}")
            fname = name or getattr(f, "__name__", None) or type(f).__name__
            self._check_name(fname)
            self._functions.append(_Registered(fname, f, float(weight), _is_async(f), _wants_client(f)))
            return f

        return add if fn is None else add(fn)

    def add_reward_model(
        self,
        *,
        weight: float = 1.0,
        name: str = "rm",
        text_fn: Callable[[RewardSample], str] = sample_text,
        batch_size: int = 64,
        normalize: bool = False,
        reduce: Reduction | None = None,
    ) -> None:
        """Add the reward model's score of each sample as a component (batched requests)."""
        if self.client is None:
            raise ValueError("add_reward_model needs a scoring client: RewardLoop(client=...)")
        check_async_client(self.client, "RewardLoop.add_reward_model")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._rm is not None:
            raise ValueError("a reward model is already added to this loop")
        self._check_name(name)
        self._rm = _RewardModelComponent(name, float(weight), text_fn, batch_size, normalize, reduce)

    @property
    def components(self) -> list[str]:
        return [f.name for f in self._functions] + ([self._rm.name] if self._rm else [])

    async def _rm_scores(self, samples: Sequence[RewardSample]) -> list[float]:
        rm, client = self._rm, self.client
        assert rm is not None and client is not None  # add_reward_model checked both
        texts = [rm.text_fn(s) for s in samples]
        raw: list[Score] = []
        for start in range(0, len(texts), rm.batch_size):
            raw.extend(await client.score_batch(texts[start : start + rm.batch_size], normalize=rm.normalize))
        try:
            return [reduce_score(v, rm.reduce, where=f"sample {i}") for i, v in enumerate(raw)]
        except CreditAssignmentError as exc:
            raise RewardFunctionError(f"reward model component {rm.name!r}: {exc}") from exc

    async def run(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        """The reward of every sample, in order."""
        if not self._functions and self._rm is None:
            raise ValueError(
                "no reward function registered: use loop.register(fn) or loop.add_reward_model()"
            )
        samples = list(samples)
        if not samples:
            return []
        gate = asyncio.Semaphore(self.max_concurrency)
        loop = asyncio.get_running_loop()
        needs_threads = any(not f.is_async for f in self._functions)
        executor = (
            ThreadPoolExecutor(
                max_workers=min(self.max_concurrency, len(samples)), thread_name_prefix="rewardplane-reward"
            )
            if needs_threads
            else None
        )

        async def call(f: _Registered, i: int, sample: RewardSample) -> tuple[float, dict[str, Any]]:
            kwargs = {"client": self.client} if f.wants_client else {}
            async with gate:
                try:
                    if f.is_async:
                        value = await f.fn(sample, **kwargs)  # type: ignore[misc]
                    else:
                        value = await loop.run_in_executor(
                            executor, functools.partial(f.fn, sample, **kwargs)
                        )
                        if inspect.isawaitable(value):
                            raise TypeError("it returned an awaitable although it was not detected as async")
                except RewardFunctionError:
                    raise
                except Exception as exc:
                    raise RewardFunctionError(
                        f"reward function {f.name!r} failed on sample {i}: {type(exc).__name__}: {exc}"
                    ) from exc
            return parse_result(value, name=f.name, index=i)

        coros: list[Any] = [call(f, i, s) for i, s in enumerate(samples) for f in self._functions]
        if self._rm is not None:
            coros.append(self._rm_scores(samples))
        try:
            outputs = await gather_or_cancel(coros)
        finally:
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

        nf = len(self._functions)
        rm_scores: list[float] | None = outputs.pop() if self._rm is not None else None
        results: list[RewardResult] = []
        for i in range(len(samples)):
            components: dict[str, float] = {}
            extra: dict[str, dict[str, Any]] = {}
            total = 0.0
            for k, f in enumerate(self._functions):
                score, info = outputs[i * nf + k]
                components[f.name] = score
                total += f.weight * score
                if info:
                    extra[f.name] = info
            if rm_scores is not None and self._rm is not None:
                components[self._rm.name] = rm_scores[i]
                total += self._rm.weight * rm_scores[i]
            results.append(RewardResult(score=total, components=components, extra=extra))
        return results
