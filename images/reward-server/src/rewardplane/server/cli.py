"""``python -m rewardplane.server``: load the engine, then serve HTTP with uvicorn."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
from pathlib import Path

from .config import ServerConfig, parse_args
from .engine import RewardEngine
from .inputs import Limits
from .metrics import ServerMetrics


def create_engine(cfg: ServerConfig, metrics: ServerMetrics) -> RewardEngine:
    if cfg.engine == "vllm":
        from .vllm_engine import VLLMEngine  # import-guarded: needs the `vllm` extra

        return VLLMEngine(cfg, metrics)
    from .hf_engine import HFEngine

    return HFEngine(cfg, metrics)


def build_server_app(cfg: ServerConfig):  # -> FastAPI
    from .app import build_app
    from .control_plane import install_control_plane
    from .model_names import ModelNames

    metrics = ServerMetrics()
    engine = create_engine(cfg, metrics)
    limits = Limits(max_items=cfg.max_items_per_request, max_tokens=engine.info.max_model_len)
    return build_app(
        engine,
        limits=limits,
        metrics=metrics,
        names=ModelNames.of(cfg.name, cfg.model, cfg.model_aliases),
        control_plane=lambda app: install_control_plane(app, engine, cfg, metrics),
    )


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's stack: the way to see where a stuck update waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # In a container the server may be PID 1, for which a signal without a handler is ignored:
    # SIGTERM during the model load would wait out the pod's whole grace period. Exit instead;
    # uvicorn replaces this with its own draining handler once it serves.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_server_app(cfg)
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        hint = ""
        if isinstance(exc, OSError) and not Path(cfg.model).exists():
            hint = (
                f" (the model {cfg.model!r} is not a local path, so it is a hub id that could not be "
                "downloaded: where the hub is unreachable, deliver the model from a volume instead, "
                "e.g. spec.model.source: pvc://<claim>/<path> or file:///<path on the node>)"
            )
        print(f"rewardplane server: cannot start: {exc}{hint}", file=sys.stderr)
        return 2
    import uvicorn

    # On SIGTERM uvicorn stops accepting connections and lets in-flight requests finish (bounded
    # by the shutdown timeout) before it exits: a rolling restart loses no scored batch.
    uvicorn.run(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=cfg.shutdown_timeout_s,
    )
    return 0
