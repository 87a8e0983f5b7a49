"""An LLM judge (a generative reward model): serve a tiny causal LM with ``--task generate``,
score rollouts with ``GenerativeJudge``, teach the judge to answer ``[[9]]`` after polite answers
and ``[[1]]`` after rude ones (supervised fine-tuning), push the weights into the running server in
memory, and score again.

    .venv/bin/python examples/reward_model/llm_judge.py [--quick]

Before training the random judge answers noise: its answers cannot be read as scores, so they are
counted and written as the default (0.0). After the push every answer is a score.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import torch
from _common import Pair, arguments, local_server, optimize, split_sets
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rewardplane.sdk import (
    AsyncRewardClient,
    GenerativeJudge,
    RewardModelTrainingMode,
    Rollout,
    Step,
)
from rewardplane.tinymodel import build_tiny_causal_lm

TEMPLATE = "Rate the answer.\nQuestion: {prompt}\nAnswer: {response}"
GOOD, BAD = "[[9]]", "[[1]]"
# Training stops once the loss is below this (averaged over the last steps). A judge that gives
# every answer one verdict plateaus near 0.12 (half the verdict digits wrong, over six answer
# tokens); how long that plateau lasts varies with library versions, so a fixed step count is not
# enough to get past it.
LEARNED_LOSS = 0.02


class JudgeResult(TypedDict):
    """The ``RESULT`` line: held-out pair accuracy and unreadable answers, before and after the push."""

    example: str
    before: float
    after: float
    failures_before: int
    failures_after: int
    version: int


def rollouts_of(pairs: Sequence[Pair]) -> list[Rollout]:
    """Each pair as two rollouts: ``c<i>`` (the preferred answer) and ``r<i>`` (the rejected one)."""
    out = []
    for i, p in enumerate(pairs):
        out.append(Rollout(id=f"c{i}", steps=[Step(0, p.prompt, p.chosen)]))
        out.append(Rollout(id=f"r{i}", steps=[Step(0, p.prompt, p.rejected)]))
    return out


def sft_batch(
    judge: GenerativeJudge, tok: PreTrainedTokenizerBase, rollouts: Sequence[Rollout]
) -> dict[str, torch.Tensor]:
    """Chat prompts with the target verdict as the assistant's answer; loss on the answer only."""
    rows, labels = [], []
    for r in rollouts:
        prompt = tok.apply_chat_template(judge.messages(r), tokenize=False, add_generation_prompt=True)
        target = (GOOD if r.id.startswith("c") else BAD) + tok.eos_token
        p_ids = tok(prompt, add_special_tokens=False).input_ids
        t_ids = tok(target, add_special_tokens=False).input_ids
        rows.append(p_ids + t_ids)
        labels.append([-100] * len(p_ids) + t_ids)
    width = max(len(x) for x in rows)
    pad = int(tok.pad_token_id)
    return {
        "input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in rows]),
        "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in rows]),
        "labels": torch.tensor([y + [-100] * (width - len(y)) for y in labels]),
    }


def teach(
    model: torch.nn.Module,
    judge: GenerativeJudge,
    tok: PreTrainedTokenizerBase,
    train: list[Rollout],
    max_steps: int,
) -> list[float]:
    """Supervised fine-tuning until the loss shows the judge tells the answers apart (below
    ``LEARNED_LOSS`` over the last 5 steps), or ``max_steps``."""
    return optimize(
        model,
        lambda rng: model(**sft_batch(judge, tok, rng.sample(train, min(16, len(train))))).loss,
        lambda losses: (
            len(losses) < max_steps and not (len(losses) >= 5 and sum(losses[-5:]) / 5 < LEARNED_LOSS)
        ),
        lr=3e-3,
    )


def accuracy(rollouts: Sequence[Rollout]) -> float:
    """The share of pairs whose preferred answer the judge scored higher."""
    scores = {r.id: r.meta["rm_score"] for r in rollouts}
    pairs = len(rollouts) // 2
    return sum(scores[f"c{i}"] > scores[f"r{i}"] for i in range(pairs)) / pairs


async def judge_all(judge: GenerativeJudge, rollouts: list[Rollout]) -> tuple[float, int]:
    failures = judge.stats.failures
    await judge.score(rollouts)
    return accuracy(rollouts), judge.stats.failures - failures


def main() -> None:
    args = arguments(__doc__ or "")
    train_pairs, held_out = split_sets(args.quick)
    work = Path(tempfile.mkdtemp(prefix="rewardplane-judge-example-"))
    with local_server(work, build_tiny_causal_lm(work / "judge", seed=0), task="generate") as setup:

        async def run() -> JudgeResult:
            async with AsyncRewardClient(setup.server.url) as client:
                judge = GenerativeJudge(client, TEMPLATE, default=0.0, max_tokens=6, max_concurrency=8)
                test = rollouts_of(held_out)
                before, failed_before = await judge_all(judge, test)
                print(
                    f"before: {failed_before} of {len(test)} answers unreadable (written as 0.0); "
                    f"preferred > rejected on {before:.0%} of held-out pairs"
                )
                model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
                losses = teach(model, judge, setup.tokenizer, rollouts_of(train_pairs), max_steps=400)
                print(f"fine-tuning loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
                version = setup.pusher.push(model.state_dict(), training_mode=RewardModelTrainingMode.FULL)
                after, failed_after = await judge_all(judge, test)
                print(
                    f"after push (version {version}): {failed_after} of {len(test)} answers unreadable; "
                    f"preferred > rejected on {after:.0%} of held-out pairs"
                )
                return {
                    "example": "llm_judge",
                    "before": before,
                    "after": after,
                    "failures_before": failed_before,
                    "failures_after": failed_after,
                    "version": version,
                }

        result = asyncio.run(run())
    print("RESULT " + json.dumps(result))
    assert result["failures_after"] == 0 and result["after"] >= 0.9, (
        "the pushed judge did not learn the verdicts"
    )


if __name__ == "__main__":
    main()
