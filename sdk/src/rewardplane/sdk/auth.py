"""Deprecated: moved to ``rewardplane.protocol.auth``; this path keeps working and warns."""

from ._compat import alias

alias(__name__)
