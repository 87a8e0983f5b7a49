"""``python -m rewardplane.server``: load the engine, then serve HTTP with uvicorn."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys

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


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's stack: the way to see where a stuck update waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_server_app(cfg)
    except (ValueError, RuntimeError, OSError, ImportError) as exc:
        print(f"rewardplane server: cannot start: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(), access_log=False)
    return 0
