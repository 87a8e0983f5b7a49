"""Train the whole reward model with a Bradley–Terry loss, push every parameter into a running
server in memory, and compare held-out preferences before and after.

    .venv/bin/python examples/reward_model/train_rm_full.py [--quick]

Full training moves the backbone too (for features the frozen model does not separate); the
push sends the complete state dict, so it is the largest.
"""

from __future__ import annotations

from _common import preference_run, train

from rewardplane.sdk import RewardModelTrainingMode


def main() -> None:
    with preference_run(__doc__ or "") as run:
        setup = run.setup
        model = setup.load_model()
        losses = train(model, setup.tokenizer, run.train_pairs, steps=40 if run.args.quick else 150, lr=3e-3)
        print(f"Bradley-Terry loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        version = setup.pusher.push(model.state_dict(), training_mode=RewardModelTrainingMode.FULL)
        print(
            f"pushed the full model as version {version} (server now serves {setup.client.get_model_version()})"
        )
        run.report("full", version=version)


if __name__ == "__main__":
    main()
