"""The sliced wire on its own (GPU, four GPUs; the project's transport functions, no server): a push
of the 7B shape into one TP=2 replica's two workers (or, ``--replica-tp 1``, into two TP=1 replicas
keeping every tensor whole), from one and from two trainer ranks.

``benchmarks/sharded_push.py`` measures the whole push through a vLLM server; ``pairwise_push.py``
measures raw NCCL with one message per sender-receiver pair. This one runs the code between them —
``rewardplane.transport``'s send and receive functions over its ``Communicator`` — with the layout a
TP=2 Llama replica publishes (rows of the column-parallel weights and the embedding, columns of the
row-parallel ``o_proj``/``down_proj``, norms and head whole) and FSDP2's ``Shard(0)`` pieces on the
trainer side. Ranks 0 and 1 receive (the replica's workers), ranks 2 and 3 send.

Patterns, each into the same receivers:

- ``broadcast-1``: rank 2 broadcasts every tensor whole (``send_buckets``/``receive_buckets``, every
  tensor received in place): what the push does before the workers published their slices; the
  baseline of the sharded push's goal (two senders ≤ 0.6 of it);
- ``broadcast-2``: ranks 2 and 3 broadcast their own pieces to the whole group (each sender also
  receives the other's, into scratch): the wire of a two-rank trainer's push into receivers that do
  not slice, with every tensor received in place;
- ``sliced-1`` / ``sliced-2``: the sliced wire (``transport.slices``) from one and from two
  senders: one message per sender-receiver pair and bucket, the boxes packed back to back and
  copied out on the copy stream while the next bucket travels; ``--in-flight`` buckets at once.

Every pattern's received tensors are compared with the trainer's, element for element. Medians of
``--reps`` after one warm-up; a push's time is rank 0's wall time between two barriers.

    python benchmarks/sliced_wire.py                 # NVLink
    python benchmarks/sliced_wire.py --sockets       # NCCL's socket transport (P2P, SHM, IB off)
    python benchmarks/sliced_wire.py --replica-tp 1  # two TP=1 replicas: slices are whole tensors
    python benchmarks/sliced_wire.py --cpu --layers 2 --hidden 64   # gloo on CPU: a smoke test

Writes ``$OUT/sliced_wire-<transport>.json`` where ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.pairwise_push import (  # noqa: E402
    free_port,
    parse_four_gpu_args,
    rank_device,
    run_meta,
    run_on_four,
    write_result,
)
from rewardplane.protocol import ParamMeta, Piece, plan_buckets  # noqa: E402
from rewardplane.protocol.slices import Region, Transfer, slice_schedule  # noqa: E402
from rewardplane.transport.comm import Backend, Communicator, create_store  # noqa: E402
from rewardplane.transport.slices import IN_FLIGHT, receive_slices, send_slices  # noqa: E402
from rewardplane.transport.transfer import receive_buckets, send_buckets  # noqa: E402

PATTERNS = ("broadcast-1", "broadcast-2", "sliced-1", "sliced-2")
RECEIVERS = (0, 1)


def shapes(args: argparse.Namespace) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Llama's tensors: name -> (shape, the dimension a TP=2 worker keeps half of, or None)."""
    h, inter = args.hidden, args.intermediate
    out: dict[str, tuple[tuple[int, ...], int | None]] = {"model.embed_tokens.weight": ((args.vocab, h), 0)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v"):
            out[f"{p}self_attn.{n}_proj.weight"] = ((h, h), 0)
        out[f"{p}self_attn.o_proj.weight"] = ((h, h), 1)
        out[f"{p}mlp.gate_proj.weight"] = ((inter, h), 0)
        out[f"{p}mlp.up_proj.weight"] = ((inter, h), 0)
        out[f"{p}mlp.down_proj.weight"] = ((h, inter), 1)
        out[f"{p}input_layernorm.weight"] = ((h,), None)
        out[f"{p}post_attention_layernorm.weight"] = ((h,), None)
    out["model.norm.weight"] = ((h,), None)
    out["score.weight"] = ((1, h), None)
    return out


def layout(args: argparse.Namespace, senders: int) -> tuple[list[ParamMeta], dict[int, list[Region | None]]]:
    """The pushed tensors (split by rows between ``senders`` where the rows divide, else whole from
    one sender, alternating) and what each worker keeps of them (``--replica-tp 1``: everything)."""
    metas: list[ParamMeta] = []
    needs: dict[int, list[Region | None]] = {r: [] for r in RECEIVERS}
    for i, (name, (shape, kept_dim)) in enumerate(shapes(args).items()):
        rows = shape[0]
        if senders > 1 and len(shape) == 2 and rows % senders == 0:
            step = rows // senders
            pieces = tuple(Piece(sender=s, start=s * step, stop=(s + 1) * step) for s in range(senders))
            metas.append(ParamMeta(name=name, dtype="bfloat16", shape=shape, split_dim=0, pieces=pieces))
        else:
            metas.append(ParamMeta(name=name, dtype="bfloat16", shape=shape, sender=i % senders))
        for r in RECEIVERS:
            if kept_dim is None or args.replica_tp == 1:
                needs[r].append(None)
            else:
                half = shape[kept_dim] // 2
                needs[r].append(Region(kept_dim, r * half, (r + 1) * half))
    return metas, needs


def full_tensor(i: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Tensor ``i`` of the trainer's model: the same on every rank for a seed, so a receiver can check."""
    g = torch.Generator(device=device).manual_seed(1000 + i)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def kept(t: torch.Tensor, region: Region | None) -> torch.Tensor:
    return t if region is None else t.narrow(region.dim, region.start, region.stop - region.start)


def held(t: torch.Tensor, meta: ParamMeta, sender: int) -> torch.Tensor | None:
    """What trainer rank ``sender`` holds of tensor ``t``: its piece, the whole tensor, or nothing."""
    if not meta.pieces:
        return t if meta.sender == sender else None
    for p in meta.pieces:
        if p.sender == sender:
            return t.narrow(0, p.start, p.stop - p.start).clone()
    return None


def worker(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    cpu = args.cpu
    device = rank_device(rank, args)
    backend: Backend = "gloo" if cpu else "nccl"
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=timeout
    )  # the barriers' group (gloo: it never shares NCCL's channels with the pushes)
    store = create_store(
        "127.0.0.1", args.store_port, is_master=rank == 3, world_size=None, timeout_s=args.timeout_s
    )
    comms: dict[int, Communicator] = {}
    if rank != 3:  # one sender: ranks 0, 1 and 2
        comms[1] = Communicator(
            store, rank=rank, world_size=3, device=device, backend=backend, group_id="one", senders=1
        )
    comms[2] = Communicator(
        store, rank=rank, world_size=4, device=device, backend=backend, group_id="two", senders=2
    )
    bucket = args.bucket_mib << 20
    layouts = {n: layout(args, n) for n in (1, 2)}
    metas1, needs = layouts[1]
    plan = {n: plan_buckets(layouts[n][0], bucket) for n in (1, 2)}
    schedule: dict[int, list[list[Transfer]]] = {
        n: slice_schedule(layouts[n][0], plan[n], needs) for n in (1, 2)
    }
    sender = rank - 2
    full = {m.name: full_tensor(i, m.shape, device) for i, m in enumerate(metas1)} if rank == 2 else {}
    parts: dict[str, torch.Tensor] = {}
    if sender >= 0:
        for i, m in enumerate(layouts[2][0]):
            whole = full[m.name] if rank == 2 else full_tensor(i, m.shape, device)
            part = held(whole, m, sender)
            if part is not None:
                parts[m.name] = part
    whole_targets: list[torch.Tensor] = []
    kept_targets: list[torch.Tensor] = []
    if rank in RECEIVERS:
        whole_targets = [torch.zeros(m.shape, dtype=torch.bfloat16, device=device) for m in metas1]
        kept_targets = [
            torch.zeros(kept(t, needs[rank][i]).shape, dtype=torch.bfloat16, device=device)
            for i, t in enumerate(whole_targets)
        ]

    def run(pattern: str) -> Callable[[], object] | None:
        """This rank's part of one push of ``pattern``; None where it takes no part."""
        n = int(pattern[-1])
        if rank == 3 and n == 1:
            return None
        comm, metas, depth = comms[n], layouts[n][0], args.in_flight
        if pattern.startswith("broadcast"):
            if rank >= 2:
                tensors = full if n == 1 else parts
                return lambda: send_buckets(comm, metas, tensors, bucket, src=2, plan=plan[n], sender=sender)
            by_name = {m.name: whole_targets[i] for i, m in enumerate(metas1)}
            return lambda: receive_buckets(
                comm, metas, bucket, 2, load=lambda _: None, plan=plan[n], place=lambda m: by_name[m.name]
            )
        if rank >= 2:
            tensors = full if n == 1 else parts
            return lambda: send_slices(comm, metas, tensors, schedule[n], sender, depth)
        return lambda: receive_slices(
            comm, metas, schedule[n], rank, comm.first_sender, needs[rank], kept_targets, in_flight=depth
        )

    def verify(pattern: str) -> int:
        """Elements received wrong (receivers only)."""
        if rank not in RECEIVERS:
            return 0
        bad = 0
        for i, m in enumerate(metas1):
            expect = full_tensor(i, m.shape, device)
            whole = pattern.startswith("broadcast")
            got = whole_targets[i] if whole else kept_targets[i]
            bad += int((got != (expect if whole else kept(expect, needs[rank][i]))).sum())
            got.zero_()
        return bad

    results: dict[str, Any] = {}
    for pattern in args.pattern_list:
        go = run(pattern)
        if go is not None:
            go()  # warm-up: NCCL's connections
        dist.barrier()
        times: list[float] = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            if go is not None:
                go()
            if not cpu:
                torch.cuda.synchronize(device)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        wrong = torch.tensor([verify(pattern)])
        dist.all_reduce(wrong)
        n = int(pattern[-1])
        messages = sum(1 for ts in schedule[n] for t in ts) if pattern.startswith("sliced") else None
        results[pattern] = {"times_s": times, "wrong_elements": int(wrong), "box_messages": messages}
    if rank == 0:
        out.write_text(json.dumps(results))
    for c in comms.values():
        c.close()
    dist.destroy_process_group()


def report(results: dict[str, Any], total: int, args: argparse.Namespace) -> dict[str, Any]:
    base = statistics.median(results["broadcast-1"]["times_s"]) if "broadcast-1" in results else None
    print(f"\n{total / 1e9:.2f} GB in {args.bucket_mib} MiB buckets; medians of {args.reps}")
    print(f"{'pattern':<12} {'ms':>9} {'GB/s':>8} {'÷ broadcast-1':>14} {'boxes':>6} {'wrong':>6}")
    for p, r in results.items():
        med = statistics.median(r["times_s"])
        r.update(median_s=med, gb_s=total / med / 1e9, vs_broadcast_1=med / base if base else None)
        boxes = r["box_messages"] if r["box_messages"] is not None else "-"
        ratio = r["vs_broadcast_1"] if r["vs_broadcast_1"] is not None else float("nan")
        print(
            f"{p:<12} {med * 1e3:>9.2f} {r['gb_s']:>8.1f} {ratio:>14.3f} {boxes:>6} {r['wrong_elements']:>6}"
        )
    if "broadcast-2" in results and "sliced-2" in results:
        # two senders: what slicing gains over the two senders' broadcasts (where receivers keep
        # every byte, as TP=1 replicas do, that is the whole difference between the two wires)
        ratio = results["sliced-2"]["median_s"] / results["broadcast-2"]["median_s"]
        print(f"sliced-2 ÷ broadcast-2: {ratio:.3f}")
    if not args.cpu and base and args.replica_tp == 2 and "sliced-2" in results:
        ratio = results["sliced-2"]["vs_broadcast_1"]
        print(f"goal sliced-2 ÷ broadcast-1 <= 0.6: {ratio:.3f} {'met' if ratio <= 0.6 else 'missed'}")
    return results


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="buckets in flight on the sliced wire")
    p.add_argument(
        "--replica-tp",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: ranks 0 and 1 are one TP=2 replica's workers; 1: two TP=1 replicas, each keeping everything",
    )
    args = parse_four_gpu_args(p, PATTERNS, argv)
    if args.intermediate % 2 or args.hidden % 2 or args.vocab % 2:
        p.error("--hidden, --intermediate and --vocab must be even (two workers keep half each)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.store_port = free_port()
    results = run_on_four(worker, args, "sliced_wire")
    metas, _ = layout(args, 1)
    total = sum(m.nbytes for m in metas)
    report(results, total, args)
    meta = run_meta(args) | {"bytes": total}
    doc = {
        "meta": meta,
        "args": {k: v for k, v in vars(args).items() if k != "pattern_list"},
        "patterns": results,
    }
    write_result(doc, f"sliced_wire-{meta['transport']}.json")
    return 0 if all(r["wrong_elements"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
