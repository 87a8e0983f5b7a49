"""Loading pushed tensors without the model's Python loader, once that loader showed what it does.

vLLM's ``load_weights`` takes Hugging Face names and fuses (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) or shards them. It is Python that walks the model on every call: on a 7B model
about as long per 1 GiB bucket as the link needs to deliver the bucket, so a push can wait on the
CPU. Each tensor is, in the end, copied into a slice of one parameter. ``CopyPlan`` learns that
slice by watching the loader the first time a name arrives: the tensor goes in wrapped as a
``_Probe``, whose ``__torch_function__`` records each ``copy_`` into which it is the source. A name
whose loader did exactly that (copies of the unchanged tensor, nothing computed from it) is copied
straight into the recorded views from then on, in one ``torch._foreach_copy_``; any other use of
the tensor (a transpose, a scale, a narrow at tensor parallelism) leaves the name to the loader for
good. Names are learned in the same call that loads them, so the first push costs what it did.

The views share the parameters' storage. Anything that may move the parameters (a sleep that
discards the weights) calls ``forget``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

Loader = Callable[[list[tuple[str, torch.Tensor]]], Any]

# Off unless REWARDPLANE_DIRECT_LOAD=1: checked on CPU against loaders of vLLM's shape
# (tests/unit/test_copy_plan.py), not yet against vLLM's own on a GPU nor measured there
# (docs/gpu.md, "Next GPU session"). Off, every tensor goes through the model's loader, as before.
ENABLED = os.environ.get("REWARDPLANE_DIRECT_LOAD", "0") == "1"

# Reading a tensor's metadata does not change what the loader copies.
_METADATA = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__len__,
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.device.__get__,
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
        torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    }
)


class _Probe(torch.Tensor):
    """A pushed tensor that tells ``CopyPlan`` where the loader copied it."""

    _rp_record: Callable[[torch.Tensor | None], None]

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            probe = next((a for a in (*args, *kwargs.values()) if isinstance(a, _Probe)), None)
            if probe is not None:
                is_source_of_copy = (
                    func is torch.Tensor.copy_
                    and len(args) >= 2
                    and args[1] is probe
                    and not isinstance(args[0], _Probe)
                )
                probe._rp_record(args[0] if is_source_of_copy else None)
        with torch._C.DisableTorchFunctionSubclass():
            plain_args = [a.as_subclass(torch.Tensor) if isinstance(a, _Probe) else a for a in args]
            return func(*plain_args, **kwargs)


class CopyPlan:
    """Where each pushed name lands in the model, learned from ``load`` (the model's loader)."""

    def __init__(self, load: Loader, model: torch.nn.Module, *, enabled: bool = ENABLED) -> None:
        self._load = load
        self._model = model
        self._enabled = enabled
        self._views: dict[str, list[torch.Tensor]] = {}  # name -> parameter views it is copied into
        self._opaque: set[str] = set()  # names only the loader can load

    def forget(self) -> None:
        self._views.clear()
        self._opaque.clear()

    @property
    def direct_names(self) -> frozenset[str]:
        return frozenset(self._views)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        direct_dst: list[torch.Tensor] = []
        direct_src: list[torch.Tensor] = []
        through_loader: list[tuple[str, torch.Tensor]] = []
        learning: dict[str, list[torch.Tensor] | None] = {}
        for name, tensor in weights:
            views = self._views.get(name)
            if views is not None and all(v.shape == tensor.shape for v in views):
                direct_dst.extend(views)
                direct_src.extend([tensor] * len(views))
            elif name in self._opaque or not self._enabled or name in learning:
                through_loader.append((name, tensor))
            else:
                learning[name] = []
                through_loader.append((name, self._probe(tensor, learning, name)))
        if direct_dst:
            with torch.no_grad():
                _copy_all(direct_dst, direct_src)
        if through_loader:
            self._load(through_loader)
        if learning:
            # a copy into a scratch tensor that the loader then placed elsewhere is no plan
            live = {p.untyped_storage().data_ptr() for p in self._model.parameters()}
        for name, copies in learning.items():
            if copies and all(v.untyped_storage().data_ptr() in live for v in copies):
                self._views[name] = copies  # copied, unchanged, into parameters: a plain copy from now on
            else:  # transformed, skipped or copied elsewhere: the loader's, for good
                self._opaque.add(name)

    @staticmethod
    def _probe(
        tensor: torch.Tensor, learning: dict[str, list[torch.Tensor] | None], name: str
    ) -> torch.Tensor:
        probe = tensor.as_subclass(_Probe)

        def record(destination: torch.Tensor | None) -> None:
            copies = learning.get(name)
            if copies is None:
                return  # already disqualified
            if destination is None or destination.shape != tensor.shape:
                learning[name] = None
            else:
                copies.append(destination)

        probe._rp_record = record
        return probe


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])``: one fused launch per dtype pair (``copy_`` casts, e.g. a bf16
    push into an fp32 head, as the loaders do)."""
    same = [(d, s) for d, s in zip(dst, src, strict=True) if d.dtype == s.dtype and d.device == s.device]
    if same:
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
    for d, s in zip(dst, src, strict=True):
        if d.dtype != s.dtype or d.device != s.device:
            d.copy_(s)
