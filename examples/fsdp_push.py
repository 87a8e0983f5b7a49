"""A trainer of several processes (FSDP2) pushing its reward model into running reward servers:
every rank sends its own shards from its own device, nothing is gathered, and the servers commit
the new version only once every rank's bytes arrived.

Start it with torchrun, on every node of the trainer. ``--model`` is the checkpoint the servers
serve (the trainer starts from the same weights); a stand-in training step changes every weight,
the trainer pushes, and rank 0 checks that the served scores equal the trainer's own (an FSDP2
forward pass on every rank).

Direct mode, the servers' URLs (their control-plane token in ``REWARDPLANE_TOKEN``):

    torchrun --nproc-per-node 2 examples/fsdp_push.py --model DIR --urls http://HOST:8000

Through the operator, a RewardModel (each rank needs the Kubernetes API: a Pod's ServiceAccount
allowed to create WeightSyncs and ConfigMaps, as in docs/operator.md):

    torchrun --nnodes 2 --node-rank R --master-addr HOST0 --nproc-per-node 8 \\
        examples/fsdp_push.py --model DIR --reward-model rm --namespace default --interface eth0

Across hosts the reward servers connect to every trainer rank (NCCL opens connections both ways):
``--interface`` names the network interface the ranks give NCCL and gloo, and ``--trainer-host``
the address the servers reach rank 0 at (docs/weight-sync.md, "Across hosts").
GPUs: NCCL, rank i on ``cuda:LOCAL_RANK``; without GPUs: gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from _demo import TEXTS, one_label
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rewardplane.sdk import RewardClient, RewardModelHandle, RewardModelTrainingMode, WeightPusher


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the served checkpoint (a transformers directory)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--urls", nargs="+", help="direct mode: the reward servers' base URLs")
    target.add_argument("--reward-model", help="through the operator: the RewardModel's name")
    p.add_argument("--namespace", default="default", help="the RewardModel's namespace")
    p.add_argument("--group-port", type=int, default=51216, help="direct mode: the push group's port")
    p.add_argument("--trainer-host", help="the address the servers reach rank 0 at (default: found)")
    p.add_argument("--interface", help="the network interface NCCL and gloo use on every rank")
    p.add_argument("--timeout-s", type=float, default=300.0, help="bound on the push")
    return p.parse_args(argv)


@torch.no_grad()
def trainer_scores(model: torch.nn.Module, tokenizer: object, device: torch.device) -> list[float]:
    """The trainer's own scores of TEXTS (a collective: FSDP2 gathers each layer on every rank)."""
    out = []
    for text in TEXTS:
        inputs = tokenizer(text, return_tensors="pt").to(device)  # type: ignore[operator]
        out.append(float(model(**inputs).logits[0, 0]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.interface:  # before the trainer's own group forms
        os.environ.setdefault("GLOO_SOCKET_IFNAME", args.interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", args.interface)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        # loaded on the CPU: fully_shard moves each block to this rank's device as it shards it,
        # so no GPU ever holds the whole model
        model = AutoModelForSequenceClassification.from_pretrained(args.model, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in getattr(model.base_model, "layers", []):  # decoder blocks first, then the rest
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # every parameter now a DTensor: this rank holds its rows

        with torch.no_grad():  # stand-in for a training step: every rank changes its own shards
            for p in model.parameters():
                p.mul_(1.01)
        want = trainer_scores(model, tokenizer, device)

        state = model.state_dict()  # DTensors: each rank's shards, nothing gathered
        full = RewardModelTrainingMode.FULL
        token = os.environ.get("REWARDPLANE_TOKEN")
        handle = None
        if args.urls:
            with WeightPusher(
                args.urls,
                group_port=args.group_port,
                token=token,
                device=device,
                trainer_group=dist.group.WORLD,
                trainer_host=args.trainer_host,
            ) as pusher:
                version = pusher.push(state, training_mode=full)  # on every rank; one version
        else:
            handle = RewardModelHandle(args.reward_model, args.namespace)
            version = handle.get_weights_version() + 1 if rank == 0 else 0  # one version for all ranks
            shared = [version]
            dist.broadcast_object_list(shared, src=0)
            result = handle.push_weights(
                state,
                int(shared[0]),
                full,
                timeout_s=args.timeout_s,
                trainer_group=dist.group.WORLD,
                interface=args.interface,
                trainer_host=args.trainer_host,
            )
            version = result.version
        if rank == 0:  # the check: rank 0 alone asks the servers
            with RewardClient(args.urls, token=token) if handle is None else handle.client() as client:
                served = one_label(client.score_batch(TEXTS, normalize=False))
                served_version = client.get_model_version()
            worst = max(abs(a - b) for a, b in zip(served, want, strict=True))
            print(f"pushed version {version} from {dist.get_world_size()} ranks")
            print(f"served  {[round(s, 4) for s in served]} (version {served_version})")
            print(f"trainer {[round(s, 4) for s in want]}; largest difference {worst:.2e}")
            if worst > (5e-2 if cuda else 1e-3):  # bf16 on GPU: the trainer's and vLLM's kernels differ
                print("the served scores are not the trainer's", file=sys.stderr)
                return 1
        if handle is not None:
            handle.close()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
