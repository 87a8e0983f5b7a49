"""When the final decoder layer may run on each prompt's last token only (pure decision).

A reward model pools the hidden state of each prompt's last token (LAST pooling). Every other row's
output of the final decoder layer is computed and thrown away: its attention output projection,
MLP and the final norm, 2-4% of a forward pass at 0.4B-7B for prompts of 64-1024 tokens. The
vLLM engine can skip that work (``vllm_last_token``): the compiled model stops after the final
layer's attention, which still runs on every token so the KV (and prefix) cache stays complete, and
the rest of the layer runs eagerly on the pooled rows. That is only right where nothing else reads
the other rows and nothing captures the eager part in a CUDA graph; ``why_every_row`` names the
first condition that does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineFacts:
    """What the decision needs of vLLM's configuration in a worker."""

    pooling: str | None  # the sequence pooling type ("LAST", "CLS", "MEAN"), None without a pooler
    lora: bool  # vLLM's LoRA kernels map adapters by token position: they need every row
    pipeline_parallel: int  # a non-final stage has no final layer and no norm
    micro_batching: bool  # dual-batch overlap: attention metadata is a list, one per micro-batch
    full_cuda_graphs: bool  # a graph around the whole model would capture the eager part with fixed rows
    sequence_parallel: bool  # the residual stream is split by token across ranks inside the graph
    breakable_cuda_graph: bool  # VLLM_USE_BREAKABLE_CUDAGRAPH=1 also wraps the whole model
    v2_model_runner: bool  # VLLM_USE_V2_MODEL_RUNNER=1: another runner, its row layout unchecked
    layers: int


def why_every_row(f: EngineFacts) -> str | None:
    """``None`` when the final layer may run on the pooled rows only; else why it runs on every row."""
    reasons = (
        (f.pooling != "LAST", f"pooling is {f.pooling or 'not set'}, not LAST (other rows are read)"),
        (f.lora, "LoRA is enabled (its kernels map adapters by token position)"),
        (f.pipeline_parallel != 1, f"pipeline parallel size is {f.pipeline_parallel}"),
        (f.micro_batching, "micro-batching (dual-batch overlap) is on"),
        (f.full_cuda_graphs, "full CUDA graphs are on (they would capture the eager rows)"),
        (f.sequence_parallel, "sequence parallelism is on (rows are split across ranks)"),
        (f.breakable_cuda_graph, "VLLM_USE_BREAKABLE_CUDAGRAPH=1 wraps the whole model in a graph"),
        (f.v2_model_runner, "VLLM_USE_V2_MODEL_RUNNER=1 (the pooled rows are checked with the V1 runner)"),
        (f.layers < 1, "the model has no decoder layer"),
    )
    return next((why for applies, why in reasons if applies), None)
