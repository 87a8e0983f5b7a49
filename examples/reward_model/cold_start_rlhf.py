"""Cold-start RLHF on one machine: train a reward model on preferences, push it into the running
server, then improve a toy policy with the server's scores through the scorer and a GRPO credit
assigner, printing the weights.

    .venv/bin/python examples/reward_model/cold_start_rlhf.py [--quick]

The toy policy picks an answer for each prompt from 16 candidates (on- or off-topic, polite or
rude closer) with a softmax over per-prompt logits. Each iteration samples a group of answers per
prompt, the reward model scores them (``RewardModelScorer``), a rule gives the env reward (1 when
the answer is on topic), ``make_rm_grpo_assigner`` turns both into group-normalised weights
(``bonus`` mode: env + rm_coeff · rm), and a policy-gradient step follows the weights.
"""

from __future__ import annotations

import asyncio
import math
import random

from _common import BAD, GOOD, TOPICS, preference_run, train

from rewardplane.sdk import (
    AsyncRewardClient,
    RewardModelScorer,
    RewardModelTrainingMode,
    Rollout,
    Step,
    make_rm_grpo_assigner,
    select_head,
)

GROUP = 4


def candidates(topic: str) -> list[str]:
    bodies = [f"Here is something about {topic}.", "Here is something about nothing at all."]
    return [f"{b} {c}" for b in bodies for c in GOOD + BAD]


def is_good(topic: str, answer: str) -> bool:
    return topic in answer and any(answer.endswith(g) for g in GOOD)


def probabilities(logits: list[float]) -> list[float]:
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


def good_mass(policy: dict[str, list[float]]) -> float:
    """Mean probability of an on-topic, polite answer over the prompts."""
    shares = []
    for topic, logits in policy.items():
        p = probabilities(logits)
        shares.append(sum(pi for pi, a in zip(p, candidates(topic), strict=True) if is_good(topic, a)))
    return sum(shares) / len(shares)


async def improve_policy(url: str, token: str | None, iterations: int) -> tuple[float, float]:
    rng = random.Random(0)
    topics = TOPICS[7:]  # prompts the reward model was not trained on
    policy = {t: [0.0] * len(candidates(t)) for t in topics}
    start = good_mass(policy)
    assigner = make_rm_grpo_assigner(GROUP, mode="bonus", rm_coeff=1.0, group_key="prompt")
    async with AsyncRewardClient(url, token=token) as client:
        scorer = RewardModelScorer(client, batch_size=32)
        for it in range(iterations):
            rollouts, picks = [], {}
            for t in topics:
                p = probabilities(policy[t])
                for g in range(GROUP):
                    a = rng.choices(range(len(p)), weights=p)[0]
                    answer = candidates(t)[a]
                    rid = f"{t}/{it}/{g}"
                    picks[rid] = (t, a)
                    env = 1.0 if t in answer else 0.0  # rule-based reward: stays on topic
                    rollouts.append(
                        Rollout(rid, [Step(0, f"Tell me about {t}.", answer, reward=env)], {"prompt": t})
                    )
            await scorer.score(rollouts)
            weights = assigner.compute(rollouts)
            if it == 0:
                print("iteration 0 (first prompt's group): env, rm score -> weight")
                for r in rollouts[:GROUP]:
                    print(
                        f"  {r.steps[0].action!r:70} env {r.steps[0].reward:.0f}, rm {r.meta['rm_score']:.3f}"
                        f" -> {weights[(r.id, 0)]:+.3f}"
                    )
            for r in rollouts:  # REINFORCE with the weight as the advantage
                t, a = picks[r.id]
                p = probabilities(policy[t])
                w = weights[(r.id, 0)]
                policy[t] = [x + 0.5 * w * ((1.0 if k == a else 0.0) - p[k]) for k, x in enumerate(policy[t])]
    return start, good_mass(policy)


def main() -> None:
    with preference_run(__doc__ or "") as run:
        setup, quick = run.setup, run.args.quick
        model = setup.load_model(head_only=True)
        train(model, setup.tokenizer, run.train_pairs, steps=60 if quick else 200, lr=0.05)
        version = setup.pusher.push(
            select_head(model.state_dict()), training_mode=RewardModelTrainingMode.HEAD_ONLY
        )
        print(f"reward model trained and pushed as version {version}")
        start, end = asyncio.run(improve_policy(setup.server.url, setup.client.token, 10 if quick else 30))
        print(f"policy: P(on-topic and polite) {start:.2f} -> {end:.2f}")
        # the policy's scoring leaves the served weights as they are: the held-out result stands
        run.report("cold_start_rlhf", policy_before=start, policy_after=end)
        assert end > start + 0.2, "the policy did not move towards the answers the reward model prefers"


if __name__ == "__main__":
    main()
