"""How a weight change keeps the engine from reusing KV blocks computed with the old weights.

vLLM's ``reset_prefix_cache`` walks every KV block in Python in the engine process (thousands of
blocks for a 7B at half a GPU), and that process also runs the worker thread that receives a push,
so the walk competes with the push for the GIL. The server instead salts every request with the
weights' cache epoch (vLLM hashes a request's salt into its first block, so no block made under
another epoch ever matches): a weight change only advances the epoch, an attribute write under the
exclusive weights lock, and the old blocks age out of the cache like any free block.
"""

from __future__ import annotations


class CacheEpoch:
    """The salt every request carries."""

    def __init__(self) -> None:
        self.epoch = 0

    def salt(self) -> str:
        """The cache salt for a request made now."""
        return f"rewardplane-weights-{self.epoch}"

    def weights_changed(self) -> None:
        """Call under the exclusive weights lock (no request reads the salt then) after every
        weight change: the epoch advances, and that is all."""
        self.epoch += 1
