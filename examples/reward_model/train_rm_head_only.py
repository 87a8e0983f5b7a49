"""Train only the reward head with a Bradley–Terry loss, push it into a running server in memory,
and compare held-out preferences before and after.

    .venv/bin/python examples/reward_model/train_rm_head_only.py [--quick]

Head-only training fits features the frozen backbone already separates (here: how an answer
ends); the push sends only ``score.weight``, so it is the smallest and fastest.
"""

from __future__ import annotations

from _common import arguments, local_server, preference_accuracy, report, split_sets, train

from rewardplane.sdk import RewardModelTrainingMode, select_head


def main() -> None:
    args = arguments(__doc__ or "")
    train_pairs, held_out = split_sets(args.quick)
    with local_server() as setup:
        before = preference_accuracy(setup.client, held_out)
        model = setup.load_model()
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("score.")
        losses = train(model, setup.tokenizer, train_pairs, steps=60 if args.quick else 200, lr=0.05)
        print(f"Bradley-Terry loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        version = setup.pusher.push(
            select_head(model.state_dict()), training_mode=RewardModelTrainingMode.HEAD_ONLY
        )
        print(f"pushed the head as version {version} (server now serves {setup.client.get_model_version()})")
        after = preference_accuracy(setup.client, held_out)
        report("head_only", before, after, version=version)


if __name__ == "__main__":
    main()
