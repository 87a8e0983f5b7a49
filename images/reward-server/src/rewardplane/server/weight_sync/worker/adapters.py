"""Adapter-only sync: serving pushed LoRA tensors as the adapter every request scores with (vLLM's
LoRA manager here; the transformers engine's is ``engines/lora_hooks.py``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rewardplane.protocol import AdapterConfig, ParamMeta, settings
from rewardplane.protocol.adapters import LORA_PAIR
from rewardplane.server.engines.vllm_lora import (
    IN_MEMORY_PATH,
    PEFT_PREFIX,
    VLLMInternalsChanged,
    loading_from_memory,
    lora_model_from_tensors,
    peft_adapter_config,
)
from rewardplane.server.weight_sync.worker.state import PushedAdapter, WorkerState
from rewardplane.transport.buckets import unpack_bucket

log = logging.getLogger(__name__)


class Adapters:
    """Serving a staged adapter push: the LoRA tensors through the engine's adapter support, the
    plain parameters (e.g. the head) loaded in place."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def apply(
        self, metadata: list[dict[str, Any]], adapter: dict[str, Any], adapter_id: int
    ) -> dict[str, Any]:
        """Serve the staged LoRA tensors as adapter ``adapter_id`` (replacing the current one), and load
        the staged plain parameters (e.g. the head) in place. The adapter is built and loaded before
        anything changes: a bad one leaves the old adapter serving. Returns where it was written
        (``path``, None when built in memory) and when each step ended (``times``, monotonic: the
        update's timeline)."""
        state = self.state
        metas = [ParamMeta(**m) for m in metadata]
        staged, state.staged = state.staged or [], None
        lora: dict[str, torch.Tensor] = {}
        plain: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in staged:
            for name, tensor in unpack_bucket(bucket, metas, buf):
                if LORA_PAIR.match(name):
                    lora[name] = tensor.clone()  # the staged buffer is freed; the adapter outlives it
                else:
                    plain.append((name, tensor))
        times = {"adapter_unpacked": time.monotonic()}
        path = state.host.set_adapter(PushedAdapter(lora, AdapterConfig(**adapter), adapter_id, times))
        state.kept = None  # adapters are not persisted (docs/weight-sync.md)
        if plain:
            state.host.load(plain)
        times["adapter_plain_loaded"] = time.monotonic()
        return {"path": path, "times": times}


class VLLMAdapters:
    """The adapter a vLLM worker serves, through its LoRA manager (``add_lora``/``remove_lora``)."""

    # Whether adapters are built in memory (every worker of the process): off once vLLM's internals differ.
    lora_from_memory = True

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        # The adapter served: its id and where it was written (None: built in memory).
        self.served: tuple[int, Path | None] | None = None

    def set(self, pushed: PushedAdapter) -> str | None:
        """Serve ``pushed``'s tensors as its adapter id through the worker's LoRA manager, then
        drop the previous adapter. Scoring requests name it (``ServedAdapter``). The adapter is
        built from the tensors where they are (``vllm_lora.py``); where this vLLM's LoRA manager is
        not shaped for that, it is written in PEFT's format to a tmpfs directory and loaded from
        there (vLLM's public path). Returns that directory, or None. ``pushed.times`` gets when the
        adapter was built (or written), added to vLLM, and the previous one dropped."""
        from vllm.lora.request import LoRARequest

        tensors, adapter, adapter_id, times = pushed.tensors, pushed.config, pushed.adapter_id, pushed.times
        name = f"rp-adapter-{adapter_id}"
        worker = self.worker
        if VLLMAdapters.lora_from_memory:
            try:
                manager = worker.model_runner.lora_manager
                lora = lora_model_from_tensors(manager, adapter_id, tensors, adapter)
                times["adapter_built"] = time.monotonic()
                with loading_from_memory(manager, adapter_id, lora):
                    loaded = worker.add_lora(LoRARequest(name, adapter_id, IN_MEMORY_PATH))
            except VLLMInternalsChanged as e:
                log.warning("adapters are loaded from a directory from now on (slower): %s", e)
                VLLMAdapters.lora_from_memory = False
            else:
                if not loaded:
                    raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
                times["adapter_added"] = time.monotonic()
                self.drop()
                self.served = (adapter_id, None)
                times["adapter_previous_dropped"] = time.monotonic()
                return None
        path = _adapter_root() / str(adapter_id)
        write_peft_adapter(path, tensors, adapter)
        times["adapter_written"] = time.monotonic()
        try:
            if not worker.add_lora(LoRARequest(name, adapter_id, str(path))):
                raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        times["adapter_added"] = time.monotonic()
        self.drop()
        self.served = (adapter_id, path)
        times["adapter_previous_dropped"] = time.monotonic()
        return str(path)

    def drop(self) -> None:
        """Back to the base weights alone (a full or merged push replaces what the adapter adapted)."""
        old, self.served = self.served, None
        if old is not None:
            self.worker.remove_lora(old[0])
            if old[1] is not None:
                shutil.rmtree(old[1], ignore_errors=True)


def _adapter_root() -> Path:
    """Where this worker writes adapters (``--adapter-dir``, in the environment the workers inherit):
    tmpfs where there is one (they are small and short-lived)."""
    base = settings.ADAPTER_DIR.get() or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return Path(base) / f"rewardplane-adapters-{os.getpid()}"


def write_peft_adapter(path: Path, tensors: dict[str, torch.Tensor], adapter: AdapterConfig) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (names under
    ``base_model.model.``), the form vLLM's ``LoRARequest`` loads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(list(tensors), adapter)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
