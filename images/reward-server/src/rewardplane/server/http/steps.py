"""Process reward models on the server side: a solution's steps become one token sequence with the
step tag after each step (the server inserts the tags), and the head's rows at the tags become step
scores and their aggregate. Pure functions over a tokenizer and plain data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rewardplane.protocol import ProcessRewardConfig, ScoringResult, StepAggregation, StepScore
from rewardplane.protocol.steps import (
    aggregate,
    good_log_odds,
    log_odds,
    probability,
    split_steps,
    step_spans,
)
from rewardplane.server.errors import BadRequest


@dataclass(frozen=True)
class Solution:
    """One solution as scored: its token ids, where each step's tag sits, each step's characters
    in the solution as sent and its tokens ``[start, end)`` (the tag at ``end - 1``)."""

    ids: list[int]
    tags: list[int]
    spans: list[tuple[int, int]]
    token_spans: list[tuple[int, int]]
    first: int = 0  # the index of the first step scored (the earlier ones are context)

    def from_step(self, k: int, index: int) -> Solution:
        """The same sequence with only steps ``k...`` scored."""
        if k == 0:
            return self
        if k >= len(self.tags):
            raise BadRequest(
                f"first_step {k} but solution {index} has {len(self.tags)} steps: send first_step below that"
            )
        return Solution(self.ids, self.tags[k:], self.spans[k:], self.token_spans[k:], first=k)


def solution_steps(
    texts: Sequence[str] | None, steps: Sequence[Sequence[str]] | None, separator: str
) -> list[tuple[list[str], list[tuple[int, int]]]]:
    """Each solution's steps and their character spans, from texts with separators or step lists."""
    if steps is not None:
        return [(list(s), step_spans(s, separator)) for s in steps]
    out = []
    for text in texts or []:
        pieces = split_steps(text, separator)
        out.append(([p for p, _ in pieces], [span for _, span in pieces]))
    return out


def build_solution(
    tokenizer: Any,
    prompt: str,
    steps: Sequence[str],
    spans: Sequence[tuple[int, int]],
    *,
    tag_id: int,
    tag: str,
    index: int,
) -> Solution:
    """The token sequence ``prompt + step_1 + tag + step_2 + tag ...``. The tag splits the
    tokenizer's text, so each step is tokenized on its own (the prompt joins the first step)."""
    if not steps:
        raise BadRequest(
            f"solution {index} has no steps: send at least one non-blank step (a text is split at the "
            "server's step separator, GET /model_info process.step_separator)"
        )
    first = tokenizer(prompt + steps[0], add_special_tokens=True, return_offsets_mapping=bool(prompt))
    rest = tokenizer(list(steps[1:]), add_special_tokens=False)["input_ids"] if len(steps) > 1 else []
    segments = [list(first["input_ids"]), *(list(r) for r in rest)]
    ids: list[int] = []
    tags: list[int] = []
    token_spans: list[tuple[int, int]] = []
    for k, seg in enumerate(segments):
        if tag_id in seg:
            where = "its prompt or first step" if k == 0 else f"step {k}"
            raise BadRequest(
                f"solution {index}: {where} contains the step tag {tag!r}; the server inserts the tags "
                "after each step itself — send the steps without it"
            )
        start = len(ids)
        if k == 0 and prompt:  # the step begins at the first token that reaches past the prompt
            ends = [int(e) for _, e in first["offset_mapping"]]
            start = next((i for i, e in enumerate(ends) if e > len(prompt)), len(seg))
        ids.extend(seg)
        tags.append(len(ids))
        ids.append(tag_id)
        token_spans.append((start, len(ids)))
    return Solution(ids=ids, tags=tags, spans=list(spans), token_spans=token_spans)


def check_length(solution: Solution, max_tokens: int, index: int) -> None:
    """A solution over the model's length cannot be cut: the cut would drop step tags."""
    if len(solution.ids) > max_tokens:
        raise BadRequest(
            f"solution {index} has {len(solution.ids)} tokens with its {len(solution.tags)} step tags; the "
            f"limit is {max_tokens} (--max-model-len): send fewer or shorter steps, or score the solution's "
            "steps in parts (each part carrying the steps before it as its prompt)"
        )


def resolve_aggregation(asked: StepAggregation | None, cfg: ProcessRewardConfig) -> StepAggregation | None:
    return asked if asked is not None else cfg.aggregation


def require_aggregation(
    asked: StepAggregation | None, cfg: ProcessRewardConfig, route: str
) -> StepAggregation:
    """A route that answers one number per solution needs an aggregation."""
    how = resolve_aggregation(asked, cfg)
    if how is None:
        raise BadRequest(
            f"{route} answers one score per input, and this process reward model has no step aggregation: "
            "start it with --step-aggregation min|mean|last|product (RewardModel "
            "spec.model.process.aggregation), or use POST /score, which answers every step's score"
        )
    return how


def step_result(
    index: int,
    rows: Sequence[Sequence[float]],
    solution: Solution,
    cfg: ProcessRewardConfig,
    how: StepAggregation | None,
    *,
    normalize: bool,
) -> ScoringResult:
    """One solution's answer: each step's score (probability of the good label, or its log-odds
    unnormalized) and, as ``score``, the aggregate — the list of step scores without one."""
    if len(rows) != len(solution.tags):
        raise RuntimeError(f"the engine gave {len(rows)} rows for {len(solution.tags)} step tags")
    raw = [good_log_odds(r, cfg.good_label) for r in rows]
    probs = [probability(x) for x in raw]
    values = probs if normalize else raw
    steps = [
        StepScore(index=solution.first + k, score=v, span=span, tokens=tokens)
        for k, (v, span, tokens) in enumerate(zip(values, solution.spans, solution.token_spans, strict=True))
    ]
    if how is None:
        score: float | list[float] = list(values)
    else:
        agg = aggregate(probs, how)
        score = agg if normalize else log_odds(agg)
    return ScoringResult(index=index, score=score, num_tokens=len(solution.ids), steps=steps)
