"""Shared by the vLLM GPU tests: starting vLLM reward servers, reading scores, comparing them with
the transformers model (the reference), and checking a push landed."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rewardplane.testing.gpus import visible_gpus
from rewardplane.testing.pushers import loopback_pusher
from rewardplane.testing.servers import ServerHandle, launch_server, wait_healthy

TOKEN = "gpu-test-token"
MAX_ABS = 0.05  # bf16 noise on unit-scale scores (README: 0.020 measured on 0.39B)
MIN_PEARSON = 0.999
# The tiny bf16 Llama of the judge and PRM tests: head dims of 64 (FlashAttention needs multiples
# of 8); the keywords of rewardplane.tinymodel's builders.
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_position_embeddings": 1024,
    "dtype": "bfloat16",
}
STARTUP_S = float(os.environ.get("RP_VLLM_STARTUP_S", "600"))

# A long text, scored before each push so its prefix blocks sit in vLLM's prefix cache.
REPEATED = (
    "The reward model reads the whole conversation, weighs how helpful, honest and harmless the "
    "final answer is, and returns one number that the policy tries to push up during training."
)
TEXTS = [
    REPEATED,
    "The assistant answered the question clearly and politely.",
    "no",
    "Here is a long and careful explanation of gradient descent, step by step, with an example: "
    "start from a guess, compute the slope, take a small step downhill, and repeat until it settles.",
    "Kubernetes restarts containers that crash.",
    "A short poem about the sea at night.",
    "def add(a, b): return a + b",
    "Thank you!",
    "The capital of France is Paris.",
    "I cannot help with that request, but here is a safer alternative you might consider.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Sure! First, preheat the oven. Then mix flour, sugar and eggs; bake for twenty minutes.",
    "The answer is 42.",
    "Let me think about this carefully before answering, because the question has two parts.",
    "Bonjour, comment allez-vous ?",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z",
]


# ---- helpers ---------------------------------------------------------------------------------


def device_count() -> int:
    import torch

    return torch.cuda.device_count()


def vllm_lacks_moe_kernels() -> str | None:
    """Why this vLLM build cannot run a mixture-of-experts model, or None: a build stripped for
    pooling runs (the device bundle drops ``vllm/_moe_C*.so``) has no fused-MoE kernels."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed"
    if not any(Path(spec.origin).parent.glob("_moe_C*.so")):
        return f"this vLLM build has no MoE kernels (no _moe_C*.so beside {spec.origin})"
    return None


def start_vllm_server(
    model_dir: Path,
    log_dir: Path,
    *,
    gpu: int | str,
    gpu_memory_utilization: float = 0.3,
    env: dict[str, str] | None = None,
    **opts: Any,
) -> ServerHandle:
    """Start (do not wait): the server runs on the GPU(s) named (``"0,1"`` with
    ``tensor_parallel_size=2``; indices of this process's devices, so a job given GPUs 2,3 puts
    ``gpu=0`` on GPU 2), seen as its devices 0...; ``opts`` become server flags, ``env`` is added to
    its environment."""
    return launch_server(
        model_dir,
        log_dir,
        token=TOKEN,
        engine="vllm",
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=1024,
        extra_args=shlex.split(os.environ.get("RP_VLLM_SERVER_ARGS", "")),
        env_extra={
            "CUDA_VISIBLE_DEVICES": visible_gpus(gpu),
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            **(env or {}),
        },
        **opts,
    )


def wait_ready(handle: ServerHandle, timeout_s: float = STARTUP_S) -> ServerHandle:
    """vLLM starts in ~2 minutes (RP_VLLM_STARTUP_S bounds it)."""
    return wait_healthy(handle, timeout_s, poll_s=1.0)


def stop(handle: ServerHandle) -> None:
    # SIGTERM, SIGKILL after 15 s; returns once vLLM's engine core (in the server's session) is gone too
    handle.stop()


def rows_of(values: list[Any]) -> list[list[float]]:
    return [[float(x) for x in v] if isinstance(v, list) else [float(v)] for v in values]


def served(url: str, texts: list[str] = TEXTS, endpoint: str = "/score") -> tuple[list[list[float]], int]:
    if endpoint == "/score":
        body = post(url, "/score", {"input": texts, "normalize": False})
        return rows_of([d["score"] for d in sorted(body["data"], key=lambda d: d["index"])]), body["version"]
    if endpoint == "/classify":
        body = post(url, "/classify", {"input": texts, "use_activation": False})
        return [d["probs"] for d in sorted(body["data"], key=lambda d: d["index"])], body["version"]
    body = post(url, "/pooling", {"input": texts})
    return [d["data"] for d in sorted(body["data"], key=lambda d: d["index"])], body["version"]


def record_result(file_name: str, key: str, value: Any) -> None:
    """Merge ``{key: value}`` into ``$OUT/file_name`` (where ``OUT`` is set: the device runs)."""
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / file_name
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = value
        path.write_text(json.dumps(data, indent=2))


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, f"{path} answered {r.status_code}: {r.text[:2000]}"
    return r.json()


def pearson(a: list[float], b: list[float]) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in a))
    vb = math.sqrt(sum((y - mb) ** 2 for y in b))
    return cov / (va * vb) if va > 0 and vb > 0 else float("nan")


def assert_close(got: list[list[float]], ref: list[list[float]], what: str) -> None:
    flat_g = [x for row in got for x in row]
    flat_r = [x for row in ref for x in row]
    assert len(flat_g) == len(flat_r), f"{what}: {len(flat_g)} values, reference has {len(flat_r)}"
    diff = max(abs(x - y) for x, y in zip(flat_g, flat_r, strict=True))
    r = pearson(flat_g, flat_r)
    assert diff <= MAX_ABS and r > MIN_PEARSON, (
        f"{what}: max abs diff {diff:.4f} (limit {MAX_ABS}), Pearson {r:.6f} (limit {MIN_PEARSON})\n"
        f"served    {[round(x, 4) for x in flat_g[:12]]}\nreference {[round(x, 4) for x in flat_r[:12]]}"
    )


def reference_scores(model: Any, tokenizer: Any, texts: list[str], device: Any) -> list[list[float]]:
    """The transformers model's raw logits in fp32 (bf16 weights upcast), one text at a time."""
    import torch

    ref = copy.deepcopy(model).to(device=device, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for t in texts:
            ids = tokenizer(t, add_special_tokens=True, return_tensors="pt")["input_ids"].to(device)
            out.append(ref(input_ids=ids).logits[0].float().tolist())
    del ref
    torch.cuda.empty_cache()
    return out


def load_trainer_model(model_dir: Path, device: Any) -> Any:
    """As a trainer holds it: bf16 backbone, fp32 score head."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    model.score.to(torch.float32)
    return model


@dataclass
class Trainer:
    model: Any
    tokenizer: Any
    sync: Any
    device: Any
    url: str


def perturb(model: Any, scale: float, seed: int | None = None) -> None:
    """A training step's worth of change, in place (the trainer's own storages stay): every
    parameter scaled by ``1 + scale * N(0, 1)``, after ``torch.manual_seed(seed)`` where given."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + scale * torch.randn_like(p))


def push_a_training_step(t: Trainer, version: int, seed: int) -> int:
    """``perturb`` (scale 0.1, ``seed``) on the trainer's model, then a full push of it: the version
    pushed."""
    from rewardplane.protocol import RewardModelTrainingMode as Mode

    perturb(t.model, 0.1, seed=seed)
    return t.sync.push(t.model.state_dict(), version=version, training_mode=Mode.FULL)


def new_head(model: Any) -> None:
    """A freshly drawn head in place: std ``1/sqrt(hidden)``, so scores of order 1 that change."""
    import torch

    with torch.no_grad():
        head = model.score.weight
        head.copy_(torch.randn_like(head) * head.shape[1] ** -0.5)


def push_a_new_head(t: Trainer, version: int) -> int:
    """``new_head`` on the trainer's model, then a head-only push of it: the version pushed."""
    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.protocol.naming import select_head

    new_head(t.model)
    return t.sync.push(select_head(t.model.state_dict()), version=version, training_mode=Mode.HEAD_ONLY)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_config() -> Any:
    """The GPU tests' adapters: rank 8 on every projection, and a trainable copy of the head."""
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), modules_to_save=["score"])


def train_lora(peft_model: Any, seed: int) -> None:
    """As if trained, after ``torch.manual_seed(seed)``: non-zero B (so the adapter changes scores)
    and a changed head copy."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.2 * p.shape[-1] ** -0.5)


def fill_prefix_cache(url: str) -> float:
    first = served(url, [REPEATED])[0][0][0]
    again = served(url, [REPEATED])[0][0][0]  # served from cached prefix blocks
    assert abs(first - again) <= MAX_ABS
    return again


def check_after_push(t: Trainer, version: int, before_repeated: float, what: str) -> None:
    state = httpx.get(f"{t.url}/runtime_version", timeout=30).json()
    assert (state["version"], state["state"]) == (version, "serving"), state
    got, served_version = served(t.url)
    assert served_version == version
    assert_close(got, reference_scores(t.model, t.tokenizer, TEXTS, t.device), f"{what}: served vs trainer")
    # REPEATED is TEXTS[0]: its prefix was cached under the old weights; a stale cache would
    # have left its score off the trainer's, and unchanged.
    assert abs(got[0][0] - before_repeated) > 1e-3, f"{what}: the repeated prompt's score did not change"


# ---- exact checks: every live parameter's bytes ---------------------------------------------

# vLLM's Llama fuses these HF parameters (its `stacked_params_mapping`), in this order.
_FUSED = {
    ".q_proj.": ".qkv_proj.",
    ".k_proj.": ".qkv_proj.",
    ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.",
    ".up_proj.": ".gate_up_proj.",
}
_COLUMN = (".qkv_proj.", ".gate_up_proj.", "embed_tokens.")  # split along dim 0 across TP ranks
_ROW = (".o_proj.", ".down_proj.")  # split along dim 1


def server_checksums(url: str) -> tuple[int, dict[int, dict[str, tuple[str, str, list[int]]]]]:
    """(version, {tensor-parallel rank: name → (sha256, dtype, shape)}) from ``GET /param_checksums``."""
    r = httpx.get(f"{url}/param_checksums", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
    assert r.status_code == 200, f"/param_checksums answered {r.status_code}: {r.text[:2000]}"
    body = r.json()
    return body["version"], {
        w["rank"]: {n: tuple(v) for n, v in w["checksums"].items()} for w in body["workers"]
    }


def vllm_llama_checksums(
    state: dict[str, Any], *, tp_size: int = 1
) -> dict[int, dict[str, tuple[str, str, list[int]]]]:
    """What a vLLM Llama sequence classifier's workers hold after loading ``state`` (HF names): q/k/v
    and gate/up fused, column- and row-parallel layers split across ``tp_size`` ranks (each part of a
    fused parameter split on its own), the rest replicated. Per rank: name → (sha256, dtype, shape)."""
    import torch

    from rewardplane.transport.checksums import digests

    fused: dict[str, list[Any]] = {}
    for name, t in state.items():
        target = next((name.replace(k, v) for k, v in _FUSED.items() if k in name), name)
        fused.setdefault(target, []).append(t.detach())
    out: dict[int, dict[str, tuple[str, str, list[int]]]] = {}
    for rank in range(tp_size):
        shards = []
        for name, parts in fused.items():
            if any(c in name for c in _COLUMN):
                t = torch.cat([p.chunk(tp_size, dim=0)[rank] for p in parts], dim=0)
            elif any(r in name for r in _ROW) and parts[0].dim() == 2:
                t = torch.cat([p.chunk(tp_size, dim=1)[rank] for p in parts], dim=0)
            else:
                t = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            shards.append((name, t))
        out[rank] = digests(shards)
    return out


# vLLM 0.24's names for what transformers 5 holds fused per MoE layer (FusedMoE's w13 is gate
# then up, as gate_up_proj); Mixtral's block is ``block_sparse_moe`` there, ``mlp`` in transformers.
_EXPERTS = {
    ".mlp.experts.gate_up_proj": ".mlp.experts.routed_experts.w13_weight",
    ".mlp.experts.down_proj": ".mlp.experts.routed_experts.w2_weight",
}


def vllm_family_checksums(
    state: dict[str, Any], family: str, *, tp_size: int = 1
) -> dict[int, dict[str, tuple[str, str, list[int]]]]:
    """``vllm_llama_checksums`` for any family of ``rewardplane.tinymodel.FAMILIES``: the same
    fusing, the experts and Mixtral's MoE block under vLLM's names (experts: tensor-parallel size
    1 only, their sharding is not modelled here)."""
    renamed: dict[str, Any] = {}
    for name, t in state.items():
        served = next((name.replace(k, v) for k, v in _EXPERTS.items() if name.endswith(k)), name)
        if family == "mixtral":
            served = served.replace(".mlp.", ".block_sparse_moe.")
        renamed[served] = t
    if tp_size > 1 and any(".experts." in n for n in renamed):
        raise NotImplementedError("expected checksums of sharded experts")
    return vllm_llama_checksums(renamed, tp_size=tp_size)


def as_served(
    state: Mapping[str, Any], served: Mapping[str, tuple[str, str, list[int]]]
) -> tuple[dict[str, Any], list[str]]:
    """The trainer's tensors as the server holds them, and the names cast: vLLM keeps a pooling
    model's head in fp32 (its ``head_dtype``) whatever the trainer's dtype, and its loader widens a
    bf16 (or fp16) head into it, which is exact. A checksum of the trainer's bf16 bytes can never
    equal the served fp32 one, so compare against the widened tensor. ``served``: one worker's
    ``/param_checksums`` (name → digest, dtype, shape). Only widening of floats is applied: any
    other difference of dtype is left to show as a mismatch."""
    import torch

    out: dict[str, Any] = {}
    widened: list[str] = []
    for name, t in state.items():
        dtype = served.get(name, ("", "", []))[1]
        want = getattr(torch, dtype, None) if dtype else None
        if (
            isinstance(want, torch.dtype)
            and want != t.dtype
            and want.is_floating_point
            and t.dtype.is_floating_point
            and torch.finfo(want).bits > torch.finfo(t.dtype).bits
        ):
            t = t.detach().to(want)
            widened.append(name)
        out[name] = t
    return out, widened


def assert_same_parameters(
    got: dict[int, dict[str, tuple[str, str, list[int]]]],
    want: dict[int, dict[str, tuple[str, str, list[int]]]],
    what: str,
) -> None:
    """Every expected parameter on every rank, bit for bit (``lm_head`` is not used by a pooling
    model and never pushed: left out)."""
    assert sorted(got) == sorted(want), f"{what}: ranks {sorted(got)}, expected {sorted(want)}"
    for rank in want:
        g = {n: v for n, v in got[rank].items() if not n.startswith("lm_head.")}
        missing = sorted(set(want[rank]) - set(g))
        extra = sorted(set(g) - set(want[rank]))
        assert not missing and not extra, (
            f"{what}, rank {rank}: missing {missing[:5]}, unexpected {extra[:5]}"
        )
        diff = [n for n in want[rank] if tuple(g[n]) != tuple(want[rank][n])]
        assert diff == [], (
            f"{what}, rank {rank}: {len(diff)} of {len(want[rank])} parameters differ: {diff[:5]}"
        )


# ---- fixtures' bodies, shared by the multi-replica tests -------------------------------------


@contextlib.contextmanager
def running_replicas(
    model_dir: Path, log_dir: Path, placements: Sequence[Mapping[str, Any]]
) -> Iterator[list[ServerHandle]]:
    """One vLLM server per placement (``start_vllm_server`` options: ``gpu``, ...), all ready;
    every one started is stopped afterwards."""
    handles: list[ServerHandle] = []
    try:
        for placement in placements:
            handles.append(start_vllm_server(model_dir, log_dir, **placement))
        for h in handles:
            wait_ready(h)
        yield handles
    finally:
        for h in handles:
            stop(h)


def direct_sync(urls: list[str], device: Any, **options: Any) -> Any:
    """The trainer's ``WeightPusher`` to ``urls`` as every GPU test configures it; ``options``: the
    pusher's further keywords (``backend``)."""
    return loopback_pusher(
        urls, TOKEN, device=device, bucket_bytes=1 << 20, timeout_s=300, connect_timeout_s=120, **options
    )


@contextlib.contextmanager
def trainer_views(replicas: list[ServerHandle], model_dir: Path, device: Any) -> Iterator[list[Trainer]]:
    """One ``Trainer`` view per replica: the same model and sync, each checked against its own
    server; the sync is closed afterwards."""
    from transformers import AutoTokenizer

    sync = direct_sync([h.url for h in replicas], device)
    try:
        model = load_trainer_model(model_dir, device)
        tok = AutoTokenizer.from_pretrained(model_dir)
        yield [Trainer(model, tok, sync, device, h.url) for h in replicas]
    finally:
        sync.close()
