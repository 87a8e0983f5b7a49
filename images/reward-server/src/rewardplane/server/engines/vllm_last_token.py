"""A Llama (or Mistral) reward model on vLLM whose final decoder layer finishes on the pooled rows only.

LAST pooling reads one row per prompt: the last scheduled token of each request, row
``query_start_loc[1:] - 1`` of the model's output (vLLM's ``build_pooling_cursor``). The stock
model computes the final layer's attention output projection, MLP and the final norm for every
token and the pooler throws all but those rows away.

Here the compiled trunk (``LlamaModel`` under vLLM's ``torch.compile`` and piecewise CUDA graphs)
runs every layer and stops in the last one right after attention, which still runs on every token,
so the KV cache, and with it the prefix cache, stays complete. The rest of the layer runs eagerly,
outside the compiled graph, on the pooled rows, which are scattered into a zeroed full-size output.
Parameter names and shapes are the stock model's, so loading and weight pushes are unchanged.

The pooled rows come from the attention metadata of the running step, read in eager code only:
vLLM traces the compiled trunk once, in a dummy run without metadata, and keeps no guards, so
anything read inside it would be frozen. Where no metadata exists (memory profiling, warm-up and
CUDA-graph capture) or the attention backend does not carry ``query_start_loc``, every row is
computed, as in the stock model. ``last_token_tail.why_every_row`` says when the model must not
be used at all; the class then builds the stock trunk.

``vllm_worker`` registers it for ``LlamaForSequenceClassification`` (and its subclass for
``MistralForSequenceClassification``, which vLLM serves with the same model) in vLLM's worker processes,
which build the model (by name: this module is imported only then); ``REWARDPLANE_LAST_TOKEN_ONLY=0``
leaves vLLM's own model in place.
"""

from __future__ import annotations

import contextlib
import logging
from itertools import islice
from typing import Any

import torch
import vllm.envs as envs
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.models.adapters import as_seq_cls_model
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

from rewardplane.server.engines.last_token_tail import EngineFacts, why_every_row
from rewardplane.server.engines.vllm_deterministic import any_row_count

# under vLLM's logger: in its worker processes only vLLM's loggers have a handler
log = logging.getLogger("vllm.rewardplane.last_token")


def engine_facts(vllm_config: Any) -> EngineFacts:
    model, parallel, compilation = (
        vllm_config.model_config,
        vllm_config.parallel_config,
        vllm_config.compilation_config,
    )
    pooling: str | None = None
    if model.pooler_config is not None:
        with contextlib.suppress(ValueError):  # raised while no sequence pooling type is resolved
            pooling = str(model.pooler_config.get_seq_pooling_type())
    passes = compilation.pass_config
    mode = compilation.cudagraph_mode
    return EngineFacts(
        pooling=pooling,
        lora=vllm_config.lora_config is not None,
        pipeline_parallel=int(parallel.pipeline_parallel_size),
        micro_batching=bool(parallel.use_ubatching),
        full_cuda_graphs=bool(mode is not None and mode.has_full_cudagraphs()),
        sequence_parallel=bool(passes.enable_sp or passes.fuse_gemm_comms),
        breakable_cuda_graph=bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH),
        v2_model_runner=bool(envs.VLLM_USE_V2_MODEL_RUNNER),
        layers=int(model.hf_config.num_hidden_layers),
    )


class _Once:
    """Log a runtime fact once per process (the tail runs every step)."""

    def __init__(self) -> None:
        self.done: set[str] = set()

    def __call__(self, key: str, level: int, msg: str, *args: Any) -> None:
        if key not in self.done:
            self.done.add(key)
            log.log(level, msg, *args)


_once = _Once()


def pooled_rows(layer_name: str) -> torch.Tensor | None:
    """The row of each request's last scheduled token in this step, or None: compute every row."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):  # None: profile, warm-up and capture runs
        return None
    starts = getattr(metadata.get(layer_name), "query_start_loc", None)
    if starts is None:
        _once(
            "no-starts",
            logging.WARNING,
            "the attention backend's metadata has no query_start_loc: the final decoder layer runs "
            "on every row (no saving; scores are unaffected)",
        )
        return None
    return (starts[1:] - 1).long()


class LastTokenLlamaModel(LlamaModel):
    """``LlamaModel`` that stops in its final layer after attention; ``finish`` completes it.

    Inherits vLLM's compile decorator and every parameter name; ``forward`` keeps the stock
    signature, which the decorator reads for the dynamic batch dimension."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any,
        inputs_embeds: torch.Tensor | None = None,
        **extra_layer_kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual: torch.Tensor | None = None
        for layer in islice(self.layers, self.start_layer, self.end_layer - 1):
            hidden, residual = layer(positions, hidden, residual, **extra_layer_kwargs)
        last = self.layers[self.end_layer - 1]
        if residual is None:  # a one-layer model: as LlamaDecoderLayer starts its first layer
            residual, hidden = hidden, last.input_layernorm(hidden)
        else:
            hidden, residual = last.input_layernorm(hidden, residual)
        attn = last.self_attn
        qkv, _ = attn.qkv_proj(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q, k)
        attn_out = attn.attn(q, k, v)  # every token: the KV cache stays complete
        # the output rows the pooler does not read stay zero
        return attn_out, residual, torch.zeros_like(residual)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Eager: the final layer's output projection, MLP and the final norm, on the pooled rows."""
        last = self.layers[self.end_layer - 1]
        rows = pooled_rows(last.self_attn.attn.layer_name)
        if rows is not None:
            attn_out, residual = attn_out.index_select(0, rows), residual.index_select(0, rows)
            _once(
                "active",
                logging.INFO,
                "final decoder layer on the pooled rows only: %d of %d rows in the first step",
                rows.numel(),
                out.shape[0],
            )
        hidden, _ = last.self_attn.o_proj(attn_out)
        hidden, residual = last.post_attention_layernorm(hidden, residual)
        hidden, _ = self.norm(last.mlp(hidden), residual)
        return hidden if rows is None else out.index_copy_(0, rows, hidden)


class LastTokenLlamaForSequenceClassification(as_seq_cls_model(LlamaForCausalLM)):  # type: ignore[misc]
    """vLLM's Llama classifier with ``LastTokenLlamaModel`` as its trunk where that is right."""

    def _init_model(
        self, vllm_config: Any, prefix: str = "", layer_type: type[torch.nn.Module] = LlamaDecoderLayer
    ) -> LlamaModel:
        why = why_every_row(engine_facts(vllm_config))
        if why is not None:
            log.info("final decoder layer on every row: %s", why)
            return LlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        log.info("final decoder layer: output projection, MLP and norm on each prompt's last token")
        model = LastTokenLlamaModel(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)
        last = model.layers[model.end_layer - 1]
        if any_row_count(last.self_attn.o_proj, last.mlp.gate_up_proj, last.mlp.down_proj):
            # batch-invariant mode: the tail's few rows per step must not change the kernels
            log.info("batch-invariant mode: the final layer's pooled rows on vLLM's Triton matmul")
        return model

    def _init_pooler(self, vllm_config: Any, prefix: str = "") -> Any:
        pooler = super()._init_pooler(vllm_config, prefix)  # also builds the score head
        if isinstance(self.model, LastTokenLlamaModel):
            # token_classify reads every row, which are zero here: offer classify only
            pooler = DispatchPooler({"classify": pooler.poolers_by_task["classify"]})
            # the head sees one row per prompt of the step: as few as one
            any_row_count(self.score)
        return pooler

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> Any:
        out = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if isinstance(self.model, LastTokenLlamaModel):
            return self.model.finish(*out)
        return out


class LastTokenMistralForSequenceClassification(LastTokenLlamaForSequenceClassification):
    """Mistral: vLLM serves it with its Llama model (its sliding window in ``layer_types``, which
    the attention applies on every token as before)."""
