"""The root of every error rewardplane raises on purpose.

It lives in the protocol layer (standard library only) so that errors defined here, such as
``naming.WeightValidationError``, and the SDK's own errors share one base: a trainer can catch
``RewardplaneError`` for everything rewardplane raises and let other bugs through.
"""

from __future__ import annotations


class RewardplaneError(Exception):
    """Base class of every error rewardplane raises on purpose."""


# The start of the reward server's last line when it cannot read its model's files: the operator
# finds it in the container's termination message and names the cause ModelUnreadable.
MODEL_FILES_UNREADABLE = "model files unreadable"
