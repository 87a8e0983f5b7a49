"""How two senders should move a push into two receiving ranks (GPU, four GPUs; raw NCCL, no server).

The sharded push (``benchmarks/sharded_push.py``) sends each tensor-parallel worker only its slice
with NCCL point-to-point sends: two senders × two receivers in one NCCL group per bucket. This
benchmark measures the link's side of that, raw NCCL without the project's transport: the
candidate wires on the same payload, four processes, one GPU each (ranks 0 and 1 receive, 2 and 3
send), one message per sender-receiver pair and bucket (``benchmarks/sliced_wire.py`` measures the
transport's own functions):

- ``broadcast-1``: rank 2 broadcasts everything to ranks 0 and 1 (one sender broadcasting: what
  both receivers get today without slicing; the baseline);
- ``p2p-1``: rank 2 sends half to rank 0 and half to rank 1 (one sender sliced);
- ``p2p-2``: ranks 2 and 3 each send a quarter to each receiver, all four sends in one NCCL group
  per bucket (two senders sliced: the shape of the sliced wire);
- ``p2p-2-rounds``: the same bytes in two rounds per bucket, each rank talking to one peer per
  round (2→0 and 3→1, then 2→1 and 3→0), point to point;
- ``pairs-2-rounds``: the same rounds, each a broadcast on a two-rank communicator of its own
  (``dist.new_group`` per sender-receiver pair): a collective uses all of NCCL's channels, where
  point-to-point sends share fewer per peer;
- ``broadcast-2``: ranks 2 and 3 each broadcast their half of every bucket to all four ranks (the
  other sender takes part, into scratch), the two broadcasts in one NCCL group per bucket: two
  senders into receivers that keep every byte (TP=1 replicas), one message per sender and bucket;
- ``broadcast-2-pieces``: the same bytes as ``--pieces`` broadcasts per sender and bucket, the two
  senders' pieces alternating in one NCCL group: the shape of the project's broadcast wire from two
  trainer ranks, one broadcast per piece of each tensor.

In the broadcast patterns both receivers get the whole payload; in the others, half each.

Per pattern: one warm-up, then
``--reps`` timed runs (barrier, then rank 0's wall time to the last receive); figures are medians;
every received bucket is checked against the sender's fill. Ratios are taken against
``broadcast-1``; the issue's goal for two senders is ≤ 0.6.

    python benchmarks/pairwise_push.py                                  # four GPUs, NVLink, 12.3 GiB
    python benchmarks/pairwise_push.py --sockets                        # NCCL's socket transport
    python benchmarks/pairwise_push.py --cpu --mib 64                   # gloo on CPU: a smoke test

Writes ``$OUT/pairwise_push.json`` where ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RECEIVERS = (0, 1)
SENDERS = (2, 3)
PATTERNS = (
    "broadcast-1",
    "p2p-1",
    "p2p-2",
    "p2p-2-rounds",
    "pairs-2-rounds",
    "broadcast-2",
    "broadcast-2-pieces",
)
SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


Part = tuple[int, int, int, int]  # (sender, receiver, offset in the receiver's half, bytes)


def payload(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """``n`` bytes, the same for a seed on every rank (a receiver can check what it got)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


class World:
    """This rank's view: the four-rank group and the two-rank pair groups."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.bcast1 = dist.new_group([0, 1, 2])
        # every rank creates every group, in the same order
        self.pairs = {(s, r): dist.new_group(sorted((s, r))) for s in SENDERS for r in RECEIVERS}

    def broadcasts(self, sends: list[tuple[torch.Tensor, int]]) -> None:
        """``(tensor, root)`` broadcasts over all four ranks, as one NCCL group (gloo: in turn)."""
        if self.device.type != "cuda":
            for t, root in sends:
                dist.broadcast(t, src=root)
            return
        with dist._coalescing_manager(device=self.device, async_ops=True) as cm:
            for t, root in sends:
                dist.broadcast(t, src=root, async_op=True)
        cm.wait()

    def barrier(self) -> None:
        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def buckets_of(total: int, bucket: int) -> list[int]:
    n, rest = divmod(total, bucket)
    return [bucket] * n + ([rest] if rest else [])


def parts_of(pattern: str, half: int) -> list[Part]:
    """Who sends which part of each receiver's half of a bucket."""
    if pattern == "p2p-1":
        return [(2, r, 0, half) for r in RECEIVERS]
    q = half // 2
    return [(s, r, i * q, q if i == 0 else half - q) for i, s in enumerate(SENDERS) for r in RECEIVERS]


def rounds_of(parts: list[Part]) -> list[list[Part]]:
    """Round ``i`` pairs sender ``j`` with receiver ``(j + i) % 2``: one peer per rank per round."""
    out: list[list[Part]] = [[], []]
    for p in parts:
        j = SENDERS.index(p[0])
        out[(RECEIVERS.index(p[1]) - j) % 2].append(p)
    return out


def pieces_of(size: int, pieces: int) -> list[Part]:
    """Two senders' broadcasts of one bucket: each sender's half in ``pieces`` parts, alternating
    senders (receiver -1: every other rank receives)."""
    half = size // 2
    out: list[Part] = []
    for i in range(pieces):
        for j, s in enumerate(SENDERS):
            base, n = (0, half) if j == 0 else (half, size - half)
            start, stop = base + n * i // pieces, base + n * (i + 1) // pieces
            if stop > start:
                out.append((s, -1, start, stop - start))
    return out


class Plan:
    """One pattern's buffers on this rank, allocated and filled once: per bucket, the groups of
    transfers posted together (one group; or one per round), each (part, this rank's tensor)."""

    def __init__(self, w: World, pattern: str, total: int, bucket: int, pieces: int = 1) -> None:
        self.w, self.pattern = w, pattern
        self.steps: list[list[list[tuple[Part, torch.Tensor]]]] = []
        for k, size in enumerate(buckets_of(total, bucket)):
            if pattern == "broadcast-1":
                groups = [[(2, r, 0, size) for r in RECEIVERS]]
            elif pattern.startswith("broadcast-2"):
                groups = [pieces_of(size, pieces if pattern.endswith("pieces") else 1)]
            else:
                parts = parts_of(pattern, size // 2)
                groups = rounds_of(parts) if pattern.endswith("rounds") else [parts]
            self.steps.append([self._mine(g, k) for g in groups])

    def _mine(self, parts: list[Part], k: int) -> list[tuple[Part, torch.Tensor]]:
        out: list[tuple[Part, torch.Tensor]] = []
        for p in parts:
            s, r, off, n = p
            if self.w.rank == s and self.pattern == "broadcast-1" and out:
                continue  # the broadcast sends one buffer to both receivers
            if self.w.rank == s:
                out.append((p, payload(n, k * 1000 + off, self.w.device)))
            elif self.w.rank == r or r == -1:  # -1: a broadcast to all four ranks
                out.append((p, torch.empty(n, dtype=torch.uint8, device=self.w.device)))
        return out

    def run(self) -> None:
        w = self.w
        for groups in self.steps:
            for group in groups:
                if self.pattern == "broadcast-1":
                    for _, t in group:
                        dist.broadcast(t, src=2, group=w.bcast1)
                elif self.pattern.startswith("broadcast-2"):
                    w.broadcasts([(t, s) for (s, _, _, _), t in group])
                elif self.pattern.startswith("pairs"):
                    for (s, r, _, _), t in group:  # one per rank per round
                        dist.broadcast(t, src=s, group=w.pairs[(s, r)])
                else:
                    ops = [
                        dist.P2POp(dist.isend, t, r) if w.rank == s else dist.P2POp(dist.irecv, t, s)
                        for (s, r, _, _), t in group
                    ]
                    if ops:
                        for req in dist.batch_isend_irecv(ops):
                            req.wait()

    def verify(self) -> None:
        for k, groups in enumerate(self.steps):
            for group in groups:
                for (s, r, off, n), t in group:
                    if self.w.rank == r or (r == -1 and self.w.rank != s):
                        want = payload(n, k * 1000 + off, self.w.device)
                        assert torch.equal(t, want), (self.pattern, "bucket", k, "from", s, "to", r)


def rank_device(rank: int, args: argparse.Namespace) -> torch.device:
    """A benchmark process's device (GPU ``rank``, or the CPU), its transport set before NCCL starts."""
    if args.sockets:
        os.environ.update(SOCKETS_ENV)
    if args.cpu:
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def worker(rank: int, args: argparse.Namespace, port: int, out: Path) -> None:
    cpu = args.cpu
    device = rank_device(rank, args)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=4,
        timeout=datetime.timedelta(seconds=args.timeout_s),
        device_id=None if cpu else device,
    )
    w = World(rank, device)
    total = args.mib << 20 if args.mib else int(args.gib * (1 << 30))
    bucket = args.bucket_mib << 20
    results: dict[str, Any] = {}
    for pattern in args.pattern_list:
        plan = Plan(w, pattern, total, bucket, args.pieces)
        w.barrier()
        plan.run()  # warm-up: NCCL's connections
        w.barrier()
        plan.verify()
        times = []
        for _ in range(args.reps):
            w.barrier()
            t0 = time.perf_counter()
            plan.run()
            if not cpu:
                torch.cuda.synchronize(device)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        plan.verify()
        results[pattern] = times
        del plan
        if not cpu:
            torch.cuda.empty_cache()
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def report(times: dict[str, list[float]], args: argparse.Namespace, total: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    base = statistics.median(times["broadcast-1"]) if "broadcast-1" in times else None
    print(f"\npayload {total / 1e9:.2f} GB in {args.bucket_mib} MiB buckets; medians of {args.reps}")
    print(f"{'pattern':<20} {'ms':>9} {'GB/s':>8} {'÷ broadcast-1':>14}")
    for p, ts in times.items():
        med = statistics.median(ts)
        ratio = med / base if base else None
        rows[p] = {"median_s": med, "times_s": ts, "gb_s": total / med / 1e9, "vs_broadcast_1": ratio}
        print(
            f"{p:<20} {med * 1e3:>9.2f} {total / med / 1e9:>8.1f} {ratio if ratio is not None else float('nan'):>14.3f}"
        )
    for p in ("p2p-2", "p2p-2-rounds", "pairs-2-rounds"):
        r = rows.get(p, {}).get("vs_broadcast_1")
        if r is not None and not args.cpu:
            print(f"goal {p} ÷ broadcast-1 <= 0.6: {r:.3f} {'met' if r <= 0.6 else 'missed'}")
    if "broadcast-2" in rows and "broadcast-2-pieces" in rows:
        ratio = rows["broadcast-2-pieces"]["median_s"] / rows["broadcast-2"]["median_s"]
        print(f"broadcast-2-pieces ÷ broadcast-2 ({args.pieces} pieces per sender and bucket): {ratio:.3f}")
    return rows


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=12.3, help="payload per push (GiB; default: the 7B shape)")
    p.add_argument("--mib", type=int, default=0, help="payload in MiB instead (small runs)")
    p.add_argument(
        "--pieces",
        type=int,
        default=16,
        help="broadcast-2-pieces: broadcasts per sender and bucket (a 1 GiB bucket of the 7B shape "
        "holds 14-35 tensors, each split between the two senders)",
    )
    return parse_four_gpu_args(p, PATTERNS, argv)


def parse_four_gpu_args(
    p: argparse.ArgumentParser, patterns: Sequence[str], argv: list[str] | None
) -> argparse.Namespace:
    """The options every four-GPU push benchmark takes, then ``argv`` parsed and checked."""
    p.add_argument("--bucket-mib", type=int, default=1024, help="bucket size (the SDK's default: 1 GiB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--patterns", default=",".join(patterns))
    p.add_argument("--sockets", action="store_true", help="NCCL's socket transport (P2P, SHM, IB off)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke test of the patterns)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    args.pattern_list = [x.strip() for x in args.patterns.split(",") if x.strip()]
    bad = [x for x in args.pattern_list if x not in patterns]
    if bad:
        p.error(f"--patterns: unknown {bad}; choose from {', '.join(patterns)}")
    if not args.cpu and torch.cuda.device_count() < 4:
        p.error(f"needs four GPUs (found {torch.cuda.device_count()}); --cpu runs the patterns on gloo")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    total = args.mib << 20 if args.mib else int(args.gib * (1 << 30))
    rows = report(run_on_four(worker, args, "pairwise_push"), args, total)
    result = {
        "meta": run_meta(args),
        "args": {k: v for k, v in vars(args).items() if k != "pattern_list"},
        "patterns": rows,
    }
    write_result(result, "pairwise_push.json")
    return 0


def run_on_four(worker: Callable[..., None], args: argparse.Namespace, name: str) -> Any:
    """``worker(rank, args, port, out)`` in four processes; returns what rank 0 wrote to ``out``."""
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{os.getpid()}.json"
    spawn: Callable[..., Any] = mp.spawn
    spawn(worker, args=(args, free_port(), out), nprocs=4, join=True)
    try:
        return json.loads(out.read_text())
    finally:
        out.unlink()


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    """Where a four-GPU run ran (``--cpu``: gloo; ``--sockets``: NCCL's socket transport)."""
    return {
        "card": None if args.cpu else torch.cuda.get_device_name(0),
        "commit": os.environ.get("RP_COMMIT"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "torch": torch.__version__,
        "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
        "transport": "gloo" if args.cpu else ("sockets" if args.sockets else "nvlink"),
    }


def write_result(doc: dict[str, Any], filename: str) -> None:
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / filename
        path.write_text(json.dumps(doc, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
