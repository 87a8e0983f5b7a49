"""The process reward model shape people deploy (Qwen2.5-Math-PRM), for the transformers engine.

Qwen2.5-Math-PRM ships it as custom code (``Qwen2ForProcessRewardModel``, ``trust_remote_code``): a
Qwen2 backbone and a two-layer head (``score.0``: hidden → hidden, ReLU, ``score.2``: hidden → 2)
giving two logits per token. transformers' own ``Qwen2ForTokenClassification`` has a one-layer head,
whose weights vLLM's ``Qwen2ForProcessRewardModel`` does not take; this class holds the deployed
shape under the deployed names, so one checkpoint loads in both engines without remote code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Qwen2Config, Qwen2Model, Qwen2PreTrainedModel
from transformers.modeling_outputs import TokenClassifierOutput

PRM_ARCHITECTURE = "Qwen2ForProcessRewardModel"


class Qwen2ForProcessRewardModel(Qwen2PreTrainedModel):
    config_class = Qwen2Config

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = Qwen2Model(config)
        self.score = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size),
            nn.ReLU(),
            nn.Linear(config.hidden_size, int(config.num_labels or 2)),
        )
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> TokenClassifierOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        # the head may run in its own dtype (fp32, like vLLM); a PEFT wrapper of it is no Sequential
        head_dtype = next(self.score.parameters()).dtype
        return TokenClassifierOutput(logits=self.score(hidden.to(head_dtype)))


def process_model_class(config: Any) -> Any:
    """The class that loads a process reward model checkpoint of ``config``: the deployed Qwen2 PRM
    shape here, else transformers' token classification (``AutoModelForTokenClassification``)."""
    from transformers import AutoModelForTokenClassification

    archs = list(getattr(config, "architectures", None) or [])
    if PRM_ARCHITECTURE in archs and getattr(config, "model_type", "") == "qwen2":
        return Qwen2ForProcessRewardModel
    return AutoModelForTokenClassification
