"""Adapter-only sync: serving pushed LoRA tensors as the adapter every request scores with."""

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
from rewardplane.server.weight_sync.worker.base import WorkerBase
from rewardplane.transport.buckets import unpack_bucket

log = logging.getLogger(__name__)


class AdapterPart(WorkerBase):
    """The adapter this worker serves, and how it is built (in memory, or from a PEFT directory)."""

    # The adapter this worker serves (adapter-only sync): its id and where it was written (None:
    # built in memory). Whether adapters are built in memory: off once vLLM's internals differ.
    _rp_adapter: tuple[int, Path | None] | None = None
    _rp_lora_from_memory = True

    def rp_apply_adapter(
        self, metadata: list[dict[str, Any]], adapter: dict[str, Any], adapter_id: int
    ) -> dict[str, Any]:
        """Serve the staged LoRA tensors as adapter ``adapter_id`` (replacing the current one), and load
        the staged plain parameters (e.g. the head) in place. The adapter is built and loaded before
        anything changes: a bad one leaves the old adapter serving. Returns where it was written
        (``path``, None when built in memory) and when each step ended (``times``, monotonic: the
        update's timeline)."""
        metas = [ParamMeta(**m) for m in metadata]
        staged, self._rp_staged = self._rp_staged or [], None
        lora: dict[str, torch.Tensor] = {}
        plain: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in staged:
            for name, tensor in unpack_bucket(bucket, metas, buf):
                if LORA_PAIR.match(name):
                    lora[name] = tensor.clone()  # the staged buffer is freed; the adapter outlives it
                else:
                    plain.append((name, tensor))
        times = {"adapter_unpacked": time.monotonic()}
        path = self.rp_set_adapter(lora, AdapterConfig(**adapter), adapter_id, times)
        self._rp_kept = None  # adapters are not persisted (docs/weight-sync.md)
        if plain:
            self.rp_load(plain)
        times["adapter_plain_loaded"] = time.monotonic()
        return {"path": path, "times": times}

    def rp_set_adapter(
        self,
        tensors: dict[str, torch.Tensor],
        adapter: AdapterConfig,
        adapter_id: int,
        times: dict[str, float],
    ) -> str | None:
        """vLLM: serve ``tensors`` as adapter ``adapter_id`` through the worker's LoRA manager, then
        drop the previous adapter. Scoring requests name it (``ServedAdapter``). The adapter is
        built from the tensors where they are (``vllm_lora.py``); where this vLLM's LoRA manager is
        not shaped for that, it is written in PEFT's format to a tmpfs directory and loaded from
        there (vLLM's public path). Returns that directory, or None. ``times`` gets when the
        adapter was built (or written), added to vLLM, and the previous one dropped."""
        from vllm.lora.request import LoRARequest

        name = f"rp-adapter-{adapter_id}"
        if AdapterPart._rp_lora_from_memory:
            try:
                manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
                lora = lora_model_from_tensors(manager, adapter_id, tensors, adapter)
                times["adapter_built"] = time.monotonic()
                with loading_from_memory(manager, adapter_id, lora):
                    loaded = self.add_lora(LoRARequest(name, adapter_id, IN_MEMORY_PATH))  # type: ignore[attr-defined]
            except VLLMInternalsChanged as e:
                log.warning("adapters are loaded from a directory from now on (slower): %s", e)
                AdapterPart._rp_lora_from_memory = False
            else:
                if not loaded:
                    raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
                times["adapter_added"] = time.monotonic()
                self._rp_drop_adapter()
                self._rp_adapter = (adapter_id, None)
                times["adapter_previous_dropped"] = time.monotonic()
                return None
        path = _adapter_root() / str(adapter_id)
        write_peft_adapter(path, tensors, adapter)
        times["adapter_written"] = time.monotonic()
        try:
            if not self.add_lora(LoRARequest(name, adapter_id, str(path))):  # type: ignore[attr-defined]
                raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        times["adapter_added"] = time.monotonic()
        self._rp_drop_adapter()
        self._rp_adapter = (adapter_id, path)
        times["adapter_previous_dropped"] = time.monotonic()
        return str(path)

    def rp_clear_adapter(self) -> None:
        """Back to the base weights alone (a full or merged push replaces what the adapter adapted)."""
        self._rp_drop_adapter()

    def _rp_drop_adapter(self) -> None:
        old, self._rp_adapter = self._rp_adapter, None
        if old is not None:
            self.remove_lora(old[0])  # type: ignore[attr-defined]
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
