"""Loading pushed tensors without the model's Python loader, once that loader showed what it does.

vLLM's ``load_weights`` takes Hugging Face names and fuses (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) or shards them, in Python that walks the model on every call: about 1.2 ms of CPU
per 25-tensor bucket of a 7B Llama (``benchmarks/copy_plan.py``), beside the 2.9 ms the link needs
for a 1 GiB bucket, and all of it after the last byte for the last bucket or a head-only push.
Each tensor is, in the end, copied into a slice of one parameter. ``CopyPlan`` learns that slice by
watching the loader the first time a name arrives: under a ``TorchFunctionMode`` it sees every
torch call the loader makes with the pushed tensor. A name whose tensor was only read for its
metadata, passed through views that are the very same tensor (vLLM's loaders ``narrow`` to the
full size at tensor-parallel size 1) or plain copies of it (``clone``), and copied into parameters
is copied straight into the recorded views from then on, in one ``torch._foreach_copy_``. One
``narrow`` (a tensor-parallel worker keeps a range of rows or columns) is followed too: the name's
``Region`` is recorded beside its view, which is what a sliced push sends this worker alone. Any
other use (a cast, a second narrow, an in-place change, a copy into scratch) leaves the name to the
loader for good. Names are learned in the call that loads them (that call costs some more CPU: each torch
call of the loader passes the watch), so no push is spent on learning alone.

The views share the parameters' storage. Anything that may move the parameters (a sleep that
discards the weights) calls ``forget``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from rewardplane.protocol.slices import Region

Loader = Callable[[list[tuple[str, torch.Tensor]]], Any]

log = logging.getLogger(__name__)

# Always on. Checked against vLLM 0.24's own models (bit-identical, 0.08 of the loader's CPU time
# per bucket) and on 2x H100, where the GPU suite's checksum tests passed with it and a head-only
# push lost the loader's ~1.4 ms after the last byte (docs/weight-sync.md).

# Reading a tensor's metadata does not change what the loader copies.
_METADATA = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.stride,
        torch.Tensor.is_contiguous,
        torch.Tensor.__len__,
        *(
            getattr(torch.Tensor, prop).__get__
            for prop in ("shape", "dtype", "device", "ndim", "is_cuda", "requires_grad")
        ),
    }
)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes seen the same way (a full-size view, ``detach``, a no-op ``to``)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


# Calls whose result holds the same values as the tensor they were given: copying from the result
# is copying from the tensor (vLLM's pooling adapter clones the first tensor of every call).
_VALUE_COPIES = frozenset({torch.Tensor.clone, torch.clone, torch.Tensor.contiguous, torch.Tensor.detach})


def _same_values(func: Any, result: torch.Tensor, source: torch.Tensor) -> bool:
    if _same_tensor(result, source):
        return True
    return (
        func in _VALUE_COPIES
        and result.shape == source.shape
        and result.dtype == source.dtype
        and result.device == source.device
    )


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


_NARROWS = frozenset({torch.Tensor.narrow, torch.narrow})


def _narrowed(args: Any, kwargs: dict[str, Any], source: torch.Tensor) -> Region | None:
    """The region ``narrow(dim, start, length)`` takes of ``source``, or None if the call does
    not say it plainly."""
    params = list(args[1:]) + [kwargs[k] for k in ("dim", "start", "length") if k in kwargs]
    if len(params) != 3 or not all(isinstance(p, int) for p in params):
        return None
    dim, start, length = params
    dim = dim % source.dim() if source.dim() else dim
    if not 0 <= start < start + length <= source.shape[dim]:
        return None
    return Region(dim, start, start + length)


class _Watch(TorchFunctionMode):
    """Follows the pushed tensors through one loader call: where each was copied (and which region
    of it), and whether anything else was done with it."""

    def __init__(self, sources: dict[str, torch.Tensor]) -> None:
        super().__init__()
        # id -> (name, tensor, region): every alias of a pushed tensor or of one narrowed range of
        # it (the tensor itself is kept, so the id stays its own while the call runs)
        self._alias: dict[int, tuple[str, torch.Tensor, Region | None]] = {
            id(t): (n, t, None) for n, t in sources.items()
        }
        self.copies: dict[str, list[tuple[torch.Tensor, Region | None]] | None] = {n: [] for n in sources}
        self.spoiled_by: dict[str, str] = {}  # name -> the first call that left it to the loader

    def _hit(self, value: Any) -> tuple[str, torch.Tensor, Region | None] | None:
        hit = self._alias.get(id(value))
        return hit if hit is not None and hit[1] is value else None

    def _name(self, value: Any) -> str | None:
        hit = self._hit(value)
        return hit[0] if hit is not None else None

    def _spoil(self, name: str, func: Any) -> None:
        self.copies[name] = None
        self.spoiled_by.setdefault(name, getattr(func, "__qualname__", None) or repr(func))

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _METADATA:
            return result
        # nested too: a tensor inside a list (torch.cat([q, k])) is used as much as a direct argument
        involved = {n for a in tree_leaves((args, kwargs)) if (n := self._name(a)) is not None}
        if not involved:
            return result
        if func is torch.Tensor.copy_ and len(args) >= 2 and self._name(args[0]) is None:
            hit = self._hit(args[1])
            if hit is not None and involved == {hit[0]}:
                copies = self.copies[hit[0]]
                if copies is not None:
                    copies.append((args[0], hit[2]))
                return result
        hit = self._hit(args[0]) if args else None
        if (
            hit is not None
            and involved == {hit[0]}
            and not _in_place(func)
            and isinstance(result, torch.Tensor)
        ):
            name, source, region = hit
            if _same_values(func, result, source):
                self._alias[id(result)] = (name, result, region)  # the same values under another name
                return result
            if func in _NARROWS and region is None:
                narrowed = _narrowed(args, kwargs, source)
                if narrowed is not None:
                    self._alias[id(result)] = (name, result, narrowed)  # a range of the pushed tensor
                    return result
        for name in involved:
            self._spoil(name, func)
        return result


def region_of(tensor: torch.Tensor, region: Region | None) -> torch.Tensor:
    """The part of ``tensor`` that ``region`` names (a view), or all of it."""
    return tensor if region is None else tensor.narrow(region.dim, region.start, region.stop - region.start)


@dataclass(frozen=True)
class _Place:
    view: torch.Tensor  # a parameter view the name (or its region) is copied into
    region: Region | None  # what of the pushed tensor lands there; None: all of it
    shape: tuple[int, ...]  # the pushed tensor's shape it was learned with

    def source(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """What of ``tensor`` is copied here, or None if it does not fit what was learned."""
        if tuple(tensor.shape) != self.shape:
            return None
        part = region_of(tensor, self.region)
        return part if part.shape == self.view.shape else None


class CopyPlan:
    """Where each pushed name lands in the model, learned from ``load`` (the model's loader)."""

    def __init__(self, load: Loader, model: torch.nn.Module) -> None:
        self._load = load
        self._model = model
        self._places: dict[str, list[_Place]] = {}  # name -> the parameter views it is copied into
        self._opaque: dict[str, str] = {}  # names only the loader can load, and why

    def forget(self) -> None:
        self._places.clear()
        self._opaque.clear()

    @property
    def direct_names(self) -> frozenset[str]:
        return frozenset(self._places)

    def why_loader(self, name: str) -> str | None:
        """Why ``name`` stays with the loader for good (what the loader did with it), or None
        (learned, or not seen yet)."""
        return self._opaque.get(name)

    def target(self, name: str) -> torch.Tensor | None:
        """The one parameter view the whole of ``name`` is copied into, or None (not learned,
        narrowed, or copied into several). Whether the pushed tensor fits it exactly is the
        receiver's check."""
        places = self._places.get(name)
        return (
            places[0].view if places is not None and len(places) == 1 and places[0].region is None else None
        )

    def slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        """What this worker keeps of ``name`` (a region, or None: all of it) and the one parameter
        view it lands in; None where the loader must see the tensor (not learned, transformed, or
        copied into several places)."""
        places = self._places.get(name)
        return (places[0].region, places[0].view) if places is not None and len(places) == 1 else None

    def held(self, name: str) -> torch.Tensor | None:
        """A parameter view that holds the whole of ``name``'s values as last loaded (the first of
        several: a plain copy puts the same values in each), or None where the loader placed it
        (not learned, narrowed, or transformed on the way). Read for sending the weights to a peer."""
        places = self._places.get(name)
        return places[0].view if places and places[0].region is None else None

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        direct_dst: list[torch.Tensor] = []
        direct_src: list[torch.Tensor] = []
        through_loader: list[tuple[str, torch.Tensor]] = []
        learning: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            places = self._places.get(name)
            if places is not None:
                parts = [p.source(tensor) for p in places]
                if all(part is not None for part in parts):
                    direct_dst.extend(p.view for p in places)
                    direct_src.extend(part for part in parts if part is not None)
                    continue
            through_loader.append((name, tensor))
            if name not in self._opaque and name not in learning:
                learning[name] = tensor
        if direct_dst:
            with torch.no_grad():
                _copy_all(direct_dst, direct_src)
        if not through_loader:
            return
        if not learning:
            self._load(through_loader)
            return
        watch = _Watch(learning)
        with watch:
            self._load(through_loader)
        # a copy into a scratch tensor that the loader then placed elsewhere is no plan
        live = {p.untyped_storage().data_ptr() for p in self._model.parameters()}
        left: dict[str, str] = {}
        for name, copies in watch.copies.items():
            if copies and all(v.untyped_storage().data_ptr() in live for v, _ in copies):
                # copied, unchanged, into parameters: a plain copy from now on
                shape = tuple(learning[name].shape)
                self._places[name] = [_Place(v, region, shape) for v, region in copies]
                continue
            # transformed, skipped or copied elsewhere: the loader's, for good
            if copies is None:
                left[name] = f"the loader called {watch.spoiled_by.get(name, 'something')} on it"
            elif copies:
                left[name] = "the loader copied it into a tensor that is not a parameter"
            else:
                left[name] = "the loader did not copy it (skipped, or read its values another way)"
        self._opaque.update(left)
        if left:
            _say_what_stays_with_the_loader(left, len(learning))


def _say_what_stays_with_the_loader(left: dict[str, str], learned: int) -> None:
    """One line per learning load: which names every later push still loads through the model's
    loader (CPU time per tensor, every push), grouped by why."""
    by_why: dict[str, list[str]] = {}
    for name, why in left.items():
        by_why.setdefault(why, []).append(name)
    log.info(
        "copy plan: %d of %d names stay with the model's loader: %s",
        len(left),
        learned,
        "; ".join(f"{why}: {len(names)}, e.g. {names[0]}" for why, names in by_why.items()),
    )


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])``: one fused launch for the pairs of equal dtype and device; the
    rest (a bf16 push into an fp32 head) one ``copy_`` each, which casts as the loaders do."""
    fused: list[tuple[torch.Tensor, torch.Tensor]] = []
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for d, s in zip(dst, src, strict=True):
        (fused if d.dtype == s.dtype and d.device == s.device else casts).append((d, s))
    if fused:
        torch._foreach_copy_([d for d, _ in fused], [s for _, s in fused])
    for d, s in casts:
        d.copy_(s)
