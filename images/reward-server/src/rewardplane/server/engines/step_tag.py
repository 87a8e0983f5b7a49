"""What a process reward model needs of its tokenizer and head, checked when an engine starts."""

from __future__ import annotations

from typing import Any

from rewardplane.protocol import ProcessRewardConfig


def step_tag_id(tokenizer: Any, tag: str, model: str) -> int:
    """The id of the step tag: one token of ``tokenizer``, else a ``ValueError`` saying what to do
    (raised at start: a PRM whose tag the tokenizer splits can score nothing)."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    tag_id = tokenizer.convert_tokens_to_ids(tag)
    if len(ids) != 1 or tag_id is None or ids[0] != tag_id or tag_id == tokenizer.unk_token_id:
        raise ValueError(
            f"the tokenizer of {model} has no token {tag!r} (it encodes as {ids}): a process reward model "
            "needs its step tag as one token — set --step-tag (RewardModel spec.model.process.stepTag) to "
            "the model's own tag (Qwen2.5-Math-PRM: <extra_0>), or add it to the tokenizer as a special token"
        )
    return int(tag_id)


def check_good_label(cfg: ProcessRewardConfig, num_labels: int, model: str) -> None:
    if num_labels > 1 and cfg.good_label >= num_labels:
        raise ValueError(
            f"--good-label {cfg.good_label} but {model} has {num_labels} labels: name one of 0..{num_labels - 1}"
        )
