"""Train only the reward head with a Bradley–Terry loss, push it into a running server in memory,
and compare held-out preferences before and after.

    .venv/bin/python examples/reward_model/train_rm_head_only.py [--quick]

Head-only training fits features the frozen backbone already separates (here: how an answer
ends); the push sends only ``score.weight``, so it is the smallest and fastest.
"""

from __future__ import annotations

from _common import preference_run, train

from rewardplane.sdk import RewardModelTrainingMode, select_head


def main() -> None:
    with preference_run(__doc__ or "") as run:
        setup = run.setup
        model = setup.load_model(head_only=True)
        losses = train(model, setup.tokenizer, run.train_pairs, steps=60 if run.args.quick else 200, lr=0.05)
        print(f"Bradley-Terry loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        version = setup.pusher.push(
            select_head(model.state_dict()), training_mode=RewardModelTrainingMode.HEAD_ONLY
        )
        print(f"pushed the head as version {version} (server now serves {setup.client.get_model_version()})")
        run.report("head_only", version=version)


if __name__ == "__main__":
    main()
