"""The worker-extension calls are named in one module, and each name is a method of the extension
(vLLM finds them by name in another process: a misspelt name fails only there, at run time)."""

from __future__ import annotations

import re
from pathlib import Path

from rewardplane.server.weight_sync import worker_calls
from rewardplane.server.weight_sync.worker_extension import HFWeightSyncWorker, RewardWeightSyncExtension

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ["core/src", "sdk/src", "operator/src", "images/reward-server/src", "src"]
NAME = re.compile(r"""["'](rp_[a-z_]+)["']""")


def test_every_call_names_a_method_of_both_engines_workers() -> None:
    names = set(NAME.findall(Path(worker_calls.__file__).read_text()))
    assert len(names) >= 20
    missing = sorted(n for n in names if not callable(getattr(RewardWeightSyncExtension, n, None)))
    assert not missing, f"worker_calls.py names methods the extension lacks: {missing}"
    assert all(callable(getattr(HFWeightSyncWorker, n, None)) for n in names)


def test_no_other_module_names_a_worker_call() -> None:
    here = Path(worker_calls.__file__).resolve()
    elsewhere = {
        str(path.relative_to(ROOT)): sorted(set(NAME.findall(path.read_text())))
        for root in SOURCE_ROOTS
        for path in (ROOT / root).rglob("*.py")
        if path.resolve() != here and NAME.search(path.read_text())
    }
    assert not elsewhere, f"call the workers through worker_calls.WorkerCalls, not by name: {elsewhere}"
