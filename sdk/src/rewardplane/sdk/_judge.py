"""Scoring rollouts with a generative reward model (an LLM judge): :class:`GenerativeJudge` renders
each rollout into a chat with a prompt template, asks a server of task ``generate``
(``POST /v1/chat/completions``) and reads a score out of each answer with a parser.

It keeps :class:`~rewardplane.sdk.RewardModelScorer`'s contract (``await judge.score(rollouts)``
writes ``rollout.meta[score_key]``, or ``step.info[score_key]`` per step, all or nothing), so a
:class:`~rewardplane.sdk.RewardModelCreditAssigner` reads its scores; and it has
``score_batch(texts)``, so it can stand in for a scoring client (``RewardModelScorer(judge)``,
``RewardLoop(client=judge)``).

An answer the parser cannot read is counted (:attr:`GenerativeJudge.stats`), logged once with
examples, and raises :class:`~rewardplane.sdk.JudgeParseError` naming the rollouts, unless a
``default`` was given: then the default is written and the answer still counted.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, get_args

from rewardplane.protocol import ChatCompletionResponse

from ._aio import gather_or_cancel
from ._credit import ScoreLevel
from ._exceptions import JudgeParseError
from ._judge_parsing import parse_score
from ._rollout import Rollout, Step
from ._scorer import rollout_text, step_text, write_scores

logger = logging.getLogger("rewardplane.sdk.judge")

Messages = list[dict[str, Any]]
Prompt = str | Sequence[Mapping[str, Any]]
"""What a template gives: the user message's text, or the whole chat (a list of messages)."""
Template = str | Callable[..., Prompt]
Parser = Callable[[str], float | None]

MAX_EXAMPLES = 5


class AsyncChatClient(Protocol):
    """What the judge needs of a client: ``chat`` (``AsyncRewardClient`` has it)."""

    async def chat(
        self, messages: Sequence[Mapping[str, Any]], **sampling: Any
    ) -> ChatCompletionResponse: ...


@dataclass
class JudgeStats:
    """What the judge's answers gave, over the judge's lifetime.

    ``answers``: answers received; ``parsed``: read as scores; ``failures``: unreadable (raised
    or written as the default); ``defaulted``: failures written as the default; ``examples``:
    the first few failures as ``(where, answer)``; ``versions``: the weights versions that answered."""

    answers: int = 0
    parsed: int = 0
    failures: int = 0
    defaulted: int = 0
    examples: list[tuple[str, str]] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)

    @property
    def failure_rate(self) -> float:
        return self.failures / self.answers if self.answers else 0.0


@dataclass(frozen=True)
class _Item:
    where: str  # e.g. "rollout 'r3'" or "step 2 of rollout 'r3'", for errors
    messages: Messages


def _fields_of(rollout: Rollout, step: Step | None) -> dict[str, str]:
    if step is not None:
        return {"prompt": step.prev_obs, "response": step.action, "text": step_text(rollout, step)}
    prompt = rollout.steps[0].prev_obs if rollout.steps else ""
    response = "\n".join(s.action for s in rollout.steps)
    return {"prompt": prompt, "response": response, "text": rollout_text(rollout)}


class GenerativeJudge:
    """Scores rollouts with an LLM judge and stores the scores in them.

    Args:
        client: an async client with ``chat`` (:class:`~rewardplane.sdk.AsyncRewardClient` pointed
            at servers of task ``generate``).
        prompt_template: a format string with the fields ``{prompt}`` (the first observation, or
            the step's), ``{response}`` (the actions, or the step's) and ``{text}`` (the whole
            rollout as :func:`rollout_text` / :func:`step_text` render it); or a function of the
            rollout (of ``(rollout, step)`` at step level) returning the user message's text or the
            whole chat (a list of ``{"role", "content"}`` messages).
        parser: reads a score from an answer's text; ``None`` or an exception means unreadable.
            Default :func:`parse_score` (``[[8]]``, ``Score: 7/10``, a bare number, ...).
        default: written for an unreadable answer (still counted). ``None`` (the default): an
            unreadable answer raises :class:`JudgeParseError` and nothing is written.
        score_key, score_level: as for :class:`~rewardplane.sdk.RewardModelScorer`.
        system_prompt: a system message put before a template's text.
        max_tokens, temperature, seed, stop: sampling of each answer (greedy by default, so a
            judge's score is repeatable); ``sampling``: more request fields (e.g. ``top_p``).
        max_concurrency: requests in flight at once; batch_size: requests per batch (batches run
            one after another, so a failure stops at its batch).
    """

    def __init__(
        self,
        client: AsyncChatClient,
        prompt_template: Template,
        parser: Parser = parse_score,
        *,
        default: float | None = None,
        score_key: str = "rm_score",
        score_level: ScoreLevel = "sequence",
        system_prompt: str | None = None,
        max_tokens: int | None = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        sampling: Mapping[str, Any] | None = None,
        max_concurrency: int = 16,
        batch_size: int = 64,
    ) -> None:
        chat = getattr(client, "chat", None)
        if not callable(chat) or not inspect.iscoroutinefunction(chat):
            raise TypeError(
                f"GenerativeJudge needs an async client with chat(), but {type(client).__name__}.chat is "
                f"{'missing' if chat is None else 'not async'}; pass an AsyncRewardClient"
            )
        if not isinstance(prompt_template, str) and not callable(prompt_template):
            raise TypeError("prompt_template must be a format string or a function of the rollout")
        if score_level not in get_args(ScoreLevel):
            raise ValueError(f"score_level must be 'sequence' or 'step', got {score_level!r}")
        if max_concurrency < 1 or batch_size < 1:
            raise ValueError(
                f"max_concurrency and batch_size must be >= 1, got {max_concurrency}, {batch_size}"
            )
        self.client = client
        self.prompt_template = prompt_template
        self.parser = parser
        self.default = default
        self.score_key = score_key
        self.score_level: ScoreLevel = score_level
        self.system_prompt = system_prompt
        self.sampling: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
            "stop": list(stop) if isinstance(stop, Sequence) and not isinstance(stop, str) else stop,
            **(sampling or {}),
        }
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.stats = JudgeStats()
        self._logged = False

    # ---- rendering (pure) ------------------------------------------------------------------
    def messages(self, rollout: Rollout, step: Step | None = None) -> Messages:
        """The chat sent for ``rollout`` (for ``step`` at step level)."""
        template = self.prompt_template
        if isinstance(template, str):
            try:
                prompt: Prompt = template.format(**_fields_of(rollout, step))
            except (KeyError, IndexError) as exc:
                raise ValueError(
                    f"prompt_template uses the field {exc}, which is not there: the fields are "
                    "{prompt}, {response} and {text} (double the braces for literal ones: {{ }})"
                ) from exc
        else:
            prompt = template(rollout) if step is None else template(rollout, step)
        if isinstance(prompt, str):
            system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            return [*system, {"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    def _items(self, rollouts: Sequence[Rollout]) -> list[_Item]:
        if self.score_level == "step":
            return [
                _Item(f"step {s.index} of rollout {r.id!r}", self.messages(r, s))
                for r in rollouts
                for s in r.steps
            ]
        return [_Item(f"rollout {r.id!r}", self.messages(r)) for r in rollouts]

    # ---- scoring -----------------------------------------------------------------------------
    async def score(self, rollouts: Sequence[Rollout]) -> None:
        """Judge ``rollouts`` and write the scores into them (all or nothing)."""
        scores = await self._judge(self._items(rollouts))
        write_scores(rollouts, scores, self.score_key, self.score_level)

    async def score_batch(self, inputs: Sequence[str], *, normalize: bool = False) -> list[float]:
        """Scores of plain texts, in order: each text is one rollout with one step whose action is
        the text (``{text}`` and ``{response}`` are the text, ``{prompt}`` is empty). Lets the judge
        stand in for a scoring client; ``normalize`` is accepted for that and ignored."""
        rollouts = [Rollout(id=f"text {i}", steps=[Step(0, "", t)]) for i, t in enumerate(inputs)]
        items = [_Item(f"text {i}", self.messages(r)) for i, r in enumerate(rollouts)]
        return await self._judge(items)

    async def _judge(self, items: list[_Item]) -> list[float]:
        gate = asyncio.Semaphore(self.max_concurrency)

        async def ask(item: _Item) -> str:
            async with gate:
                reply = await self.client.chat(item.messages, **self.sampling)
            self.stats.versions.add(reply.version)
            return reply.choices[0].message.content if reply.choices else ""

        answers: list[str] = []
        for start in range(0, len(items), self.batch_size):
            batch = items[start : start + self.batch_size]
            answers.extend(await gather_or_cancel([ask(i) for i in batch]))  # a failure cancels the rest
        return self._read(items, answers)

    def _parse(self, answer: str) -> float | None:
        try:
            value = self.parser(answer)
        except Exception:  # a user parser's error means "unreadable", like None
            return None
        return None if value is None else float(value)

    def _read(self, items: list[_Item], answers: list[str]) -> list[float]:
        values = [self._parse(a) for a in answers]
        failures = [(i.where, a) for i, a, v in zip(items, answers, values, strict=True) if v is None]
        st = self.stats
        st.answers += len(answers)
        st.parsed += len(answers) - len(failures)
        st.failures += len(failures)
        st.examples.extend(failures[: MAX_EXAMPLES - len(st.examples)])
        if failures:
            self._log(failures, len(answers))
        if failures and self.default is None:
            shown = ", ".join(w for w, _ in failures[:10]) + (
                f" and {len(failures) - 10} more" if len(failures) > 10 else ""
            )
            raise JudgeParseError(
                f"the judge's answer could not be read as a score for {len(failures)} of {len(answers)} "
                f"inputs ({shown}); e.g. {failures[0][1][:200]!r}. Nothing was written. Fix the prompt "
                "template or the parser, or pass default= to score unreadable answers with a default",
                failures,
            )
        st.defaulted += len(failures)
        return [self.default if v is None else v for v in values]  # type: ignore[misc]

    def _log(self, failures: list[tuple[str, str]], total: int) -> None:
        level = logging.DEBUG if self._logged else logging.WARNING
        self._logged = True
        examples = "; ".join(f"{w}: {a[:200]!r}" for w, a in failures[:3])
        logger.log(
            level,
            "judge: %d of %d answers could not be read as scores (%s; so far %d of %d). Examples: %s",
            len(failures),
            total,
            "written as the default" if self.default is not None else "raised",
            self.stats.failures,
            self.stats.answers,
            examples,
        )
