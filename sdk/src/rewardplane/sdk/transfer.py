"""Deprecated: moved to ``rewardplane.transport.transfer``; this path keeps working and warns."""

from ._compat import alias

alias(__name__)
