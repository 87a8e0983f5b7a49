"""``python -m rewardplane.server``: load the engine, then serve HTTP with uvicorn."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rewardplane.protocol import ModelTask, settings
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.errors import MODEL_FILES_UNREADABLE
from rewardplane.server.config import ServerConfig, parse_args
from rewardplane.server.engines.engine import RewardEngine
from rewardplane.server.heap import keep_freed_memory
from rewardplane.server.http.http_stack import choose_http_stack
from rewardplane.server.http.inputs import limits_for
from rewardplane.server.metrics import ServerMetrics
from rewardplane.server.shutdown import bounded_shutdown_server

if TYPE_CHECKING:
    from fastapi import FastAPI


def create_engine(cfg: ServerConfig, metrics: ServerMetrics) -> RewardEngine:
    # The engine's import first (a missing extra is the first thing to fix), then the model path:
    # either error is printed last by main, so it becomes the Pod's termination message
    # (FallbackToLogsOnError) and the operator's status names it.
    if cfg.engine == "vllm":
        from rewardplane.server.engines.vllm_engine import (
            VLLMEngine,  # import-guarded: needs the `vllm` extra
        )

        check_model_source(cfg.model, needs_weights=cfg.load_format != "dummy")
        return VLLMEngine(cfg, metrics)
    check_model_source(cfg.model, needs_weights=cfg.load_format != "dummy")
    if cfg.task == ModelTask.GENERATE:
        from rewardplane.server.engines.hf_generate import HFGenerativeEngine

        return HFGenerativeEngine(cfg, metrics)
    from rewardplane.server.engines.hf_engine import HFEngine

    return HFEngine(cfg, metrics)


def check_model_source(source: str, needs_weights: bool = True) -> None:
    problem = model_source_problem(source, needs_weights) or hub_problem(source)
    if problem is not None:
        raise ValueError(problem)


# Weight files transformers and vLLM load (a sharded checkpoint names its shards in an index).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.pt", "*.pth")
HUB_PROBE_TIMEOUT_S = 5.0


def hub_problem(source: str) -> str | None:
    """Why a hub id cannot be fetched, told within seconds: the hub does not answer and the id is
    not in the local Hugging Face cache (the hub client retries for about a minute before it
    says so). None for a local path, an offline hub (``HF_HUB_OFFLINE``), a cached or reachable one."""
    if Path(source).expanduser().exists():
        return None
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(source, "config.json"), str):
        return None
    import httpx

    try:
        httpx.head(constants.ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return (
            f"model {source!r} is not a local path, so it is a Hugging Face hub id, and the hub at "
            f"{constants.ENDPOINT} did not answer within {HUB_PROBE_TIMEOUT_S:g}s ({type(exc).__name__}) and "
            "the id is not in the local Hugging Face cache: pass the checkpoint's folder as --model, "
            "or set HF_HUB_OFFLINE=1 to load a copy from the cache (HF_HOME)"
        )
    return None


def build_server_app(cfg: ServerConfig) -> FastAPI:
    from rewardplane.server.http.app import build_app
    from rewardplane.server.http.model_names import ModelNames

    token = resolve_token(cfg.token, cfg.token_file)  # before the model loads: a bad token file fails fast
    if token is None:
        logging.getLogger(__name__).warning(
            "no control-plane token (--token-file, $%s or $%s): the control plane is off, so every "
            "weight push, sleep and restore is refused (403); scoring is open. Start with --token-file "
            "to take pushes",
            settings.TOKEN_FILE.name,
            settings.TOKEN.name,
        )
    metrics = ServerMetrics()
    engine = create_engine(cfg, metrics)
    limits = limits_for(cfg.max_items_per_request, engine.info.max_model_len, cfg.max_input_bytes)
    return build_app(
        engine,
        limits=limits,
        metrics=metrics,
        names=ModelNames.of(cfg.name, cfg.model, cfg.model_aliases, local_spellings(cfg.model)),
        token=token,
        weights_dir=cfg.weights_dir,
        max_request_bytes=cfg.max_request_bytes,
        require_admission=cfg.require_admission,
    )


def local_spellings(source: str) -> list[str]:
    """The absolute and the resolved path of a local ``--model`` (a trainer may name the checkpoint
    either way, whatever relative path or link the server was started with); none for a hub id."""
    path = Path(source).expanduser()
    if not path.exists():
        return []
    return [str(path.absolute()), str(path.resolve())]


def unreadable_files(path: Path) -> list[Path]:
    """The checkpoint's files (or the folder itself) this process cannot read."""
    try:
        if path.is_dir():
            if not os.access(path, os.R_OK | os.X_OK):
                return [path]
            return sorted(p for p in path.iterdir() if p.is_file() and not os.access(p, os.R_OK))
        return [path] if path.exists() and not os.access(path, os.R_OK) else []
    except PermissionError:  # a folder above it cannot be entered
        return [path]


def unreadable_message(path: Path, files: list[Path]) -> str:
    """The file, its mode and owner, this server's uid, and the fix."""
    first = files[0]
    try:
        st = first.stat()
        facts = f"mode {stat.filemode(st.st_mode)} ({st.st_mode & 0o7777:o}), owner uid {st.st_uid} gid {st.st_gid}"
    except OSError:
        facts = "cannot even be inspected"
    more = f" and {len(files) - 1} more file(s)" if len(files) > 1 else ""
    return (
        f"{MODEL_FILES_UNREADABLE}: {first} ({facts}){more} cannot be read by this server (uid {os.getuid()}, "
        f"gid {os.getgid()}); make the checkpoint readable to it: chmod -R a+rX {path} (save_pretrained as root "
        "under umask 077 writes 0600 files), or chown it to the server's uid"
    )


def model_source_problem(source: str, needs_weights: bool = True) -> str | None:
    """Why ``--model`` cannot be loaded, when that is clear before loading anything: a path that
    does not exist, or a folder that is not a checkpoint. (A hub id is left to the loader; without
    this check a missing path shows up as a Hugging Face hub error about an invalid repo id.)"""
    # Hub ids are "name" or "org/name"; anything absolute, relative-marked or deeper is a path.
    looks_like_path = source.startswith(("/", "./", "../", "~")) or source.count("/") > 1
    path = Path(source).expanduser()
    unreadable = unreadable_files(path)
    if unreadable:
        return unreadable_message(path, unreadable)
    if path.exists():
        if path.is_dir() and not (path / "config.json").exists():
            return (
                f"model not found at {source}: the folder has no config.json (not a Hugging Face "
                "checkpoint); point --model (RewardModel spec.model.source) at the checkpoint folder"
            )
        if needs_weights and path.is_dir() and not any(any(path.glob(g)) for g in WEIGHT_FILES):
            return (
                f"model at {source} has a config.json but no weights (*.safetensors or pytorch_model*.bin): "
                "save the whole checkpoint there (model.save_pretrained(folder) writes both), or copy its "
                "weight files in; --load-format dummy starts on random weights instead"
            )
        return None
    if looks_like_path:
        return (
            f"model not found at {source}: no such file or directory; fix --model (RewardModel "
            "spec.model.source) or mount the volume that holds the checkpoint"
        )
    return None


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
    cfg.export_settings()  # the flags' values, for the engine and its worker processes
    settings.warn_retired(logging.getLogger(__name__))
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

    log = logging.getLogger(__name__)
    stack = choose_http_stack()
    log.info("serving with %s", stack.describe())
    # After the model load, so the weights keep the allocations glibc chose for them.
    log.info("%s", keep_freed_memory())
    # On SIGTERM uvicorn stops accepting, waits at most --graceful-shutdown-s for requests in
    # flight (a long-poll on /runtime_version may hold 300 s), then stops the engine. Control-plane
    # waits run on daemon threads (threads.py), so nothing else should keep the process alive;
    # should something still, the exit deadline ends it with every thread's stack printed.
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        http=stack.http,
        loop=stack.loop,
        log_level=cfg.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=cfg.graceful_shutdown_s,
    )
    bounded_shutdown_server(config, cfg.graceful_shutdown_s).run()
    return 0
