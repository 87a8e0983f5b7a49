"""The root of every error rewardplane raises on purpose.

It lives in the protocol layer (standard library only) so that errors defined here, such as
``naming.WeightValidationError``, and the SDK's own errors share one base: a trainer can catch
``RewardplaneError`` for everything rewardplane raises and let other bugs through.
"""

from __future__ import annotations


class RewardplaneError(Exception):
    """Base class of every error rewardplane raises on purpose."""
