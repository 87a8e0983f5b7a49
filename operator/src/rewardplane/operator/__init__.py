"""The rewardplane operator: pure planning (spec → desired objects) apart from thin kopf handlers.

``spec``, ``planning``, ``render`` and ``status`` are pure (no I/O); ``handlers`` and ``kube`` talk
to the API server; ``__main__`` runs the operator (``python -m rewardplane.operator``).
"""
