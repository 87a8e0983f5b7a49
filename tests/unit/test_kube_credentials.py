"""Without the `kubernetes` package, reaching the cluster fails with what to install."""

from __future__ import annotations

import sys

import pytest

from rewardplane.api.kube import Kube


def test_missing_kubernetes_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # `import kubernetes` now raises ImportError
    with pytest.raises(ImportError, match=r"rewardplane\[cluster\]"):
        Kube.from_environment("/nonexistent/kubeconfig")
