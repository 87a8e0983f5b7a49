"""How a push is made, the same for both front doors (``WeightPusher`` and
``RewardModelHandle.push_weights``): each builds one :class:`PushOptions` from the keywords it is
called with, and every part of the push reads it from there instead of taking the keywords again.

Nothing here imports torch: ``rewardplane.sdk.cluster`` imports this module with the SDK.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rewardplane.protocol import DEFAULT_BUCKET_BYTES, AdapterConfig
from rewardplane.protocol.naming import DEFAULT_HEAD_PATTERNS

if TYPE_CHECKING:
    import torch

    from rewardplane.transport.comm import Backend


@dataclass(frozen=True)
class PushOptions:
    """What a push is told besides its parameters, version and training mode.

    The fields are the front doors' keywords of the same names (docs/sdk.md). Some are one door's
    only: ``connect_timeout_s``, ``atomic`` and ``data_plane`` are ``WeightPusher``'s, ``progress``
    and ``interface`` are ``push_weights``'; a door leaves the other's at their defaults."""

    trainer_host: str | None = None
    # None: WeightPusher's default device; through the operator, the device of the tensors
    device: torch.device | str | int | None = None
    backend: Backend = "auto"
    timeout_s: float = 600.0
    connect_timeout_s: float = 120.0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    atomic: bool = False
    head_name_patterns: tuple[str, ...] | None = None
    data_plane: bool = True
    delta: bool = False
    keep_lora: bool = False
    adapter: AdapterConfig | None = None
    progress: bool | None = None
    interface: str | None = None

    def __post_init__(self) -> None:
        # a list from the caller would make the options unhashable and shared with the caller
        if self.head_name_patterns is not None and not isinstance(self.head_name_patterns, tuple):
            object.__setattr__(self, "head_name_patterns", tuple(self.head_name_patterns))

    @property
    def head_patterns(self) -> tuple[str, ...]:
        """What counts as the head for head-only pushes (the default where none were given)."""
        return self.head_name_patterns or DEFAULT_HEAD_PATTERNS

    def for_push(
        self, *, keep_lora: bool, adapter: AdapterConfig | None, delta: bool | None = None
    ) -> PushOptions:
        """These options with one push's own settings (``delta`` None: the door's default)."""
        return dataclasses.replace(
            self, keep_lora=keep_lora, adapter=adapter, delta=self.delta if delta is None else delta
        )
