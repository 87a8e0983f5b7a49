"""The copy plan against vLLM's own layers and weight loaders (``server/copy_plan.py``): what it
copies directly equals what vLLM's loaders load, bit for bit, and after the first push it learned
every name of a Llama-shaped layer set (fused q/k/v and gate/up through ``weight_loader_v2``'s
full-size ``narrow``, row-parallel projections, the vocabulary embedding, a norm, an fp32 score
head fed bf16). In a subprocess: vLLM's parallel state is process-wide. Needs vLLM only; it runs
on CPU tensors. (The same script ran on this project's CPU machine against vLLM 0.24's sources
with the platform forced to CPU.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rewardplane.protocol.families import MOE_FAMILIES
from rewardplane.testing.servers import free_port
from rewardplane.tinymodel import FAMILIES

pytestmark = [pytest.mark.vllm]

SCRIPT = textwrap.dedent(
    """
import sys
import torch
from vllm.config import VllmConfig, set_current_vllm_config
ctx = set_current_vllm_config(VllmConfig()); ctx.__enter__()
from vllm.distributed import init_distributed_environment, initialize_model_parallel
init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{sys.argv[1]}", backend="gloo")
initialize_model_parallel(1, 1)
from vllm.model_executor.layers.linear import QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ReplicatedLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from rewardplane.server.weight_sync.copy_plan import CopyPlan

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(50, 16)
        self.qkv_proj = QKVParallelLinear(16, 4, 4, 2, bias=False)
        self.o_proj = RowParallelLinear(16, 16, bias=False)
        self.gate_up_proj = MergedColumnParallelLinear(16, [24, 24], bias=False)
        self.down_proj = RowParallelLinear(24, 16, bias=False)
        self.norm = RMSNorm(16)
        self.score = ReplicatedLinear(16, 1, bias=False, params_dtype=torch.float32)
        self.calls = []
    @torch.no_grad()
    def load_weights(self, weights):  # LlamaModel.load_weights' loop
        stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                   (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
        params = dict(self.named_parameters())
        self.calls.append([n for n, _ in weights])
        for name, w in weights:
            name = "." + name
            for pn, wn, sid in stacked:
                if wn not in name: continue
                name = name.replace(wn, pn)
                p = params[name[1:]]
                p.weight_loader(p, w, sid)
                break
            else:
                p = params[name[1:]]
                getattr(p, "weight_loader", default_weight_loader)(p, w)

shapes = {"embed_tokens.weight": (50, 16), "q_proj.weight": (16, 16), "k_proj.weight": (8, 16), "v_proj.weight": (8, 16),
          "o_proj.weight": (16, 16), "gate_proj.weight": (24, 16), "up_proj.weight": (24, 16), "down_proj.weight": (16, 24),
          "norm.weight": (16,), "score.weight": (1, 16)}
def push(seed):
    g = torch.Generator().manual_seed(seed)
    out = [(n, torch.randn(*s, generator=g)) for n, s in shapes.items()]
    out[-1] = (out[-1][0], out[-1][1].to(torch.bfloat16))
    return out
a, b = Tiny(), Tiny()
with torch.no_grad():
    for p in list(a.parameters()) + list(b.parameters()): p.zero_()
plan = CopyPlan(a.load_weights, a)
for seed in range(3):
    w = push(seed)
    plan.load(w); b.load_weights(w)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), (seed, n)
assert plan.direct_names == set(shapes), sorted(plan.direct_names)
assert a.calls[1:] == [], a.calls[1:]  # learned on the first push: the loader is not called again
print("OK")
    """
)


def test_the_copy_plan_learns_every_name_of_vllms_llama_layers_and_loads_them_bit_for_bit() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port())], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_the_copy_plan_learns_every_name_of_vllms_sequence_classification_models(
    arch: str, tmp_path: Path
) -> None:
    """Every family; the benchmark checks every parameter bit for bit against vLLM's loader after
    every push. The plan learns every name but the experts that transformers 5 holds fused (3-D):
    they reach vLLM's loader split per expert (``weight_sync/expert_names.py``)."""
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "copy_plan.py"
    out = tmp_path / "copy_plan.json"
    done = subprocess.run(
        [sys.executable, str(bench), "--arch", arch, "--layers", "2", "--reps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    left = result["left_to_loader"]
    assert result["bit_identical"] and result["learned"] + len(left) == result["tensors"], result
    fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert all(name.endswith(fused) for name in left), left
    assert bool(left) is (arch in MOE_FAMILIES), left


WORKER_PUSHES = """
import sys, threading, tempfile, contextlib
from dataclasses import asdict
from pathlib import Path
import torch
from benchmarks.copy_plan import build_models, checkpoint, push, trainer_shapes
from rewardplane.server.weight_sync.expert_names import expert_splitter
from rewardplane.protocol import ParamMeta
from rewardplane.server.weight_sync.worker.group import GroupJoin
from rewardplane.server.weight_sync.worker_extension import RewardWeightSyncExtension
from rewardplane.transport.comm import Communicator, create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.transfer import send_buckets

port = int(sys.argv[1])
ckpt = checkpoint(Path(tempfile.mkdtemp()), sys.argv[2], 4)
shapes = trainer_shapes(ckpt)
served, reference = build_models(ckpt, contextlib.ExitStack())


class Runner:
    def get_model(self):
        return served


class Worker(RewardWeightSyncExtension):  # what vLLM's GPU worker gives the extension
    model_runner = Runner()
    device = "cpu"
    rank = 0


worker, trainer, bucket = Worker(), {}, 1 << 14  # small buckets: many load calls
served_dtype = next(served.parameters()).dtype
for version in range(3):
    # in the served dtype: what needs no cast can be received in place (per-tensor wire)
    weights = [(n, t.to(served_dtype)) for n, t in push(shapes, version)]
    metas = [ParamMeta(name=n, dtype=str(served_dtype), shape=tuple(t.shape)) for n, t in weights]

    def send():
        if "comm" not in trainer:
            store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=60)
            trainer["store"] = store
            trainer["comm"] = open_group(
                store, rank=1, world_size=2, device=torch.device("cpu"), backend="gloo", timeout_s=60, group_id="g"
            )
        send_buckets(trainer["comm"], metas, dict(weights), bucket, src=1)
        trainer["comm"].max_flag(0)

    thread = threading.Thread(target=send)
    thread.start()
    if version == 0:
        worker.rp_init_communicator(asdict(GroupJoin("127.0.0.1", port, 2, 0, "gloo", 60, "g")))
    result = worker.rp_receive([m.model_dump() for m in metas], bucket, True, "layout")
    thread.join()
    assert result["ok"], result
    # learned on the first push, received in place from the second on
    assert (result["in_place_bytes"] > 0) == (version > 0), (version, result)
    reference.load_weights(expert_splitter(reference)(weights))  # as the worker hands its loader
    for (name, a), (_, b) in zip(served.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), (version, name)
fused = {n for n, s in shapes if len(s) == 3}  # experts: left to the loader, split per expert
assert worker.rp_parts.state.host.copy_plan.direct_names == {n for n, _ in shapes} - fused
print("OK")
"""


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
def test_the_vllm_worker_receives_pushes_through_the_copy_plan_bit_for_bit(arch: str) -> None:
    """The worker extension's own path (join the group, receive the buckets, load each through
    the copy plan) into vLLM's model, over gloo: three pushes, each equal to vLLM's loader; what
    the plan learned is received straight into vLLM's parameters. The MoE families' fused experts
    reach the loader split per expert, as the worker hands them."""
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", WORKER_PUSHES, str(free_port()), arch],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=repo,
        env={
            **os.environ,
            "PYTHONPATH": f"{repo}:{os.environ.get('PYTHONPATH', '')}",
        },
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
