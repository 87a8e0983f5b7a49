"""How a weight change keeps the engine from reusing KV blocks computed with the old weights.

vLLM's ``reset_prefix_cache`` walks every KV block in Python in the engine process (thousands of
blocks for a 7B at half a GPU), and that process also runs the worker thread that receives a push,
so the walk competes with the push for the GIL. By default the server instead salts every request
with the weights' cache epoch (vLLM hashes a request's salt into its first block, so no block made
under another epoch ever matches): a weight change only advances the epoch, an attribute write
under the exclusive weights lock, and the old blocks age out of the cache like any free block.
``REWARDPLANE_PREFIX_CACHE=reset`` keeps vLLM's engine-wide reset instead.
"""

from __future__ import annotations

from typing import Literal

from rewardplane.protocol.env import choice_from_env

Invalidation = Literal["salt", "reset"]
INVALIDATIONS: tuple[Invalidation, ...] = ("salt", "reset")


def invalidation_from_env() -> Invalidation:
    return choice_from_env(
        "REWARDPLANE_PREFIX_CACHE",
        INVALIDATIONS,
        "salt",
        " — salt: requests carry the weights' cache epoch; reset: vLLM's reset_prefix_cache after every weight change",
    )


class CacheEpoch:
    """The salt every request carries, and what a weight change must do about the cache."""

    def __init__(self, invalidation: Invalidation) -> None:
        self.invalidation = invalidation
        self.epoch = 0

    @property
    def salted(self) -> bool:
        return self.invalidation == "salt"

    def salt(self) -> str | None:
        """The cache salt for a request made now; None with the engine-wide reset."""
        return f"rewardplane-weights-{self.epoch}" if self.salted else None

    def weights_changed(self) -> bool:
        """Call under the exclusive weights lock (no request reads the salt then) after every
        weight change. Salted: the epoch advances, and that is all (False). Otherwise True: the
        engine must reset its prefix cache."""
        if not self.salted:
            return True
        self.epoch += 1
        return False
