"""A mixture of experts pushed from transformers 5, in the names vLLM's loaders read.

transformers 5 holds each MoE layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj``
``[experts, 2 * intermediate, hidden]`` (gate rows first) and ``mlp.experts.down_proj``
``[experts, hidden, intermediate]``, and writes them back per expert only when it saves a
checkpoint. vLLM 0.24's loaders read the per-expert checkpoint names: its Qwen3-MoE loader skips
the 3-D names without a word (the experts keep their old weights) and its Mixtral loader, whose
block is ``block_sparse_moe``, fails on ``mlp.gate.weight``. ``expert_splitter`` gives each
expert's slices the checkpoint's names, as views of the pushed tensors (no copy)."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

Weights = list[tuple[str, torch.Tensor]]

_FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.mlp\.gate\.weight$")


def split_fused_experts(weights: Weights, *, block_sparse_moe: bool) -> Weights:
    """``weights`` with every fused 3-D expert tensor split into its experts' checkpoint names:
    ``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`` (Qwen3-MoE), or with
    ``block_sparse_moe`` (Mixtral) ``<layer>.block_sparse_moe.experts.<e>.w{1,3,2}.weight`` and the
    router as ``<layer>.block_sparse_moe.gate.weight``. Other names pass unchanged."""
    block, (gate_name, up_name, down_name) = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if block_sparse_moe
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    out: Weights = []
    for name, tensor in weights:
        fused = _FUSED.match(name)
        router = _ROUTER.match(name) if block_sparse_moe else None
        if router is not None:
            out.append((f"{router['layer']}.block_sparse_moe.gate.weight", tensor))
        elif fused is None or tensor.dim() != 3:
            out.append((name, tensor))
        elif fused["proj"] == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                prefix = f"{fused['layer']}.{block}.experts.{e}"
                out += [(f"{prefix}.{gate_name}.weight", gate[e]), (f"{prefix}.{up_name}.weight", up[e])]
        else:
            out += [
                (f"{fused['layer']}.{block}.experts.{e}.{down_name}.weight", tensor[e])
                for e in range(tensor.shape[0])
            ]
    return out


def expert_splitter(model: torch.nn.Module) -> Callable[[Weights], Weights]:
    """``split_fused_experts`` for the served ``model`` (a vLLM model: its own parameter names say
    whether its MoE block is Mixtral's ``block_sparse_moe``); the identity where it has no experts."""
    names = [n for n, _ in model.named_parameters()]
    if not any(".experts." in n for n in names):
        return lambda weights: weights
    block_sparse_moe = any(".block_sparse_moe." in n for n in names)
    return lambda weights: split_fused_experts(weights, block_sparse_moe=block_sparse_moe)
