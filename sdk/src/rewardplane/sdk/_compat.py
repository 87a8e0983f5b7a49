"""Old import paths of modules that moved out of the SDK into the shared core.

``rewardplane.sdk.protocol`` and friends are one-line modules that replace themselves with the
module's new home (same objects, so ``isinstance`` and ``except`` keep working) and warn once
with the new path.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "rewardplane.sdk.protocol": "rewardplane.protocol",
    "rewardplane.sdk.naming": "rewardplane.protocol.naming",
    "rewardplane.sdk.auth": "rewardplane.protocol.auth",
    "rewardplane.sdk.buckets": "rewardplane.transport.buckets",
    "rewardplane.sdk.comm": "rewardplane.transport.comm",
    "rewardplane.sdk.transfer": "rewardplane.transport.transfer",
}


def alias(old: str) -> ModuleType:
    """Make ``old`` an alias of its new module (in ``sys.modules``) and return that module."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
