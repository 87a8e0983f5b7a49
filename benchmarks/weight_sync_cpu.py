"""The fixed cost of a push on CPU (gloo, the transformers engine, a tiny model): pushes announced
over HTTP against pushes started from the data plane, the same server, one run. The bytes are a
few MB, so what is timed is the control path around the transfer (call → served).

    python benchmarks/weight_sync_cpu.py --reps 20      # writes $OUT/weight_sync_cpu.json when OUT is set
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_out import report  # noqa: E402
from rewardplane.protocol import RewardModelTrainingMode as Mode  # noqa: E402
from rewardplane.protocol.naming import select_head  # noqa: E402
from rewardplane.testing.pushers import loopback_pusher  # noqa: E402
from rewardplane.testing.servers import start_server  # noqa: E402
from rewardplane.tinymodel import build_tiny_reward_model  # noqa: E402
from tests.fixtures.trainer import perturbed  # noqa: E402

TOKEN = "bench"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ws-cpu-"))
    model_dir = build_tiny_reward_model(work / "m", num_labels=1, seed=0)
    server = start_server(model_dir, work, token=TOKEN)
    params = perturbed(model_dir, seed=1).state_dict()
    head = select_head(params)
    version = 0
    out: dict[str, object] = {
        "reps": args.reps,
        "bytes_full": sum(t.numel() * t.element_size() for t in params.values()),
    }
    try:
        for data_plane in (False, True):
            pusher = loopback_pusher([server.url], TOKEN, data_plane=data_plane)
            try:
                for name, sd, mode in (("full", params, Mode.FULL), ("head_only", head, Mode.HEAD_ONLY)):
                    version += 1
                    pusher.push(sd, version=version, training_mode=mode)  # announces the layout
                    times = []
                    for _ in range(args.reps):
                        version += 1
                        t0 = time.perf_counter()
                        pusher.push(sd, version=version, training_mode=mode)
                        times.append(1000 * (time.perf_counter() - t0))
                    out[f"{name}_{'data_plane' if data_plane else 'http'}_ms_median"] = statistics.median(
                        times
                    )
            finally:
                pusher.close()
    finally:
        server.stop()
    for name in ("full", "head_only"):
        http, dp = out[f"{name}_http_ms_median"], out[f"{name}_data_plane_ms_median"]
        assert isinstance(http, float) and isinstance(dp, float)
        out[f"{name}_data_plane_over_http"] = dp / http
        print(
            f"{name:9s}: HTTP-started {http:6.2f} ms, data-plane-started {dp:6.2f} ms, ratio {dp / http:.2f}"
        )
    report(out, "weight_sync_cpu.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
