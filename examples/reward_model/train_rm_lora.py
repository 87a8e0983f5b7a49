"""Train LoRA adapters (and the head) with a Bradley–Terry loss, push the merged weights into a
running server in memory, and compare held-out preferences before and after.

    .venv/bin/python examples/reward_model/train_rm_lora.py [--quick]

The server holds plain weights, so a LoRA model is pushed merged: ``merge_sync_reinit`` merges
the adapters into the base weights, pushes the merged state dict (training mode ``lora``) and
returns the model with fresh adapters (the same function) to keep training; build a new
optimizer for it, since the old adapters' state is gone.
"""

from __future__ import annotations

from _common import preference_run, train
from peft import LoraConfig, get_peft_model

from rewardplane.sdk import RewardModelTrainingMode
from rewardplane.sdk.lora import merge_sync_reinit


def main() -> None:
    with preference_run(__doc__ or "") as run:
        setup = run.setup
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["score"],
            task_type="SEQ_CLS",
        )
        model = get_peft_model(setup.load_model(), config)
        losses = train(model, setup.tokenizer, run.train_pairs, steps=60 if run.args.quick else 200, lr=0.01)
        print(f"Bradley-Terry loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        pushed: list[int] = []
        model = merge_sync_reinit(
            model,
            lambda state: pushed.append(setup.pusher.push(state, training_mode=RewardModelTrainingMode.LORA)),
        )
        print(
            f"pushed the merged weights as version {pushed[0]} (server now serves {setup.client.get_model_version()})"
        )
        run.report("lora", version=pushed[0])


if __name__ == "__main__":
    main()
