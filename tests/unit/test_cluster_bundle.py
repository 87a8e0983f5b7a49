"""The cluster bundle for the GPU machine: folders of bounded size, a manifest that catches missing or
corrupt parts (exit 3 names the folders still to carry), and an install that rebuilds, unpacks and
runs the binaries."""

from __future__ import annotations

import lzma
import random
import zipfile
from pathlib import Path

import pytest

from rewardplane.localcluster import bundle as b

# a shell script that exits before the noise (which keeps xz from shrinking it below one folder)
FAKE_TOOL = b"#!/bin/sh\necho 'Kubernetes v1.20.2'\nexit 0\n" + random.Random(0).randbytes(2000)


def test_big_files_are_cut_and_every_folder_stays_under_the_limit() -> None:
    plan = b.plan_folders({"big.xz": 2500, "a.whl": 700, "b.whl": 300, "c.whl": 100}, 1000, "k8s")
    sizes = {f: sum(p.size for p in ps) for f, ps in plan.items()}
    assert all(s <= 1000 for s in sizes.values()), sizes
    names = sorted(p.name for ps in plan.values() for p in ps)
    assert names == ["a.whl", "b.whl", "big.xz.part-00", "big.xz.part-01", "big.xz.part-02", "c.whl"]
    pieces = sorted((p for ps in plan.values() for p in ps if p.source == "big.xz"), key=lambda p: p.index)
    assert [(p.offset, p.size) for p in pieces] == [(0, 1000), (1000, 1000), (2000, 500)]
    assert list(plan) == [f"k8s{i}" for i in range(1, len(plan) + 1)]
    assert len(plan) == 4  # 1000, 1000, 500+300+100, 700 — first fit, largest first
    with pytest.raises(b.BundleError):
        b.plan_folders({"x": 1}, 0, "k8s")


def test_the_manifest_round_trips_and_rejects_garbage() -> None:
    entries = [b.Entry("a" * 64, "k8s1", "x.whl"), b.Entry("b" * 64, "=", "y.xz")]
    text = b.manifest_text(entries, "id")
    assert sorted(b.parse_manifest(text), key=lambda e: e.name) == entries
    assert b.bundle_id_of(text) == b.bundle_id_of(b.manifest_text(entries, "other id"))
    with pytest.raises(b.BundleError, match="line 4"):
        b.parse_manifest(text + "nonsense here\n")
    with pytest.raises(b.BundleError, match="no files"):
        b.parse_manifest("# empty\n")


def test_missing_folders_skip_pieces_of_a_file_already_rebuilt() -> None:
    entries = [
        b.Entry("1" * 64, "k8s1", "big.xz.part-00"),
        b.Entry("2" * 64, "k8s2", "big.xz.part-01"),
        b.Entry("3" * 64, "=", "big.xz"),
        b.Entry("4" * 64, "k8s2", "w.whl"),
    ]
    assert b.missing_folders(entries, lambda e: False) == ["k8s1", "k8s2"]
    assert b.missing_folders(entries, lambda e: e.name == "big.xz.part-00") == ["k8s2"]
    assert b.missing_folders(entries, lambda e: e.name in ("big.xz", "w.whl")) == []


def test_dependency_closure_leaves_out_what_the_machine_has() -> None:
    graph = {"kopf": ["aiohttp", "iso8601", "python_json_logger"], "iso8601": [], "python-json-logger": []}
    got = b.dependency_closure(["kopf"], lambda n: graph.get(n, []), present=["aiohttp"])
    assert got == ["iso8601", "kopf", "python-json-logger"]


def _payload(tmp_path: Path) -> Path:
    payload = tmp_path / "payload"
    payload.mkdir()
    with lzma.open(payload / "kube-apiserver.xz", "wb", preset=0) as f:
        f.write(FAKE_TOOL)
    with zipfile.ZipFile(payload / "demo_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("demo_pkg/__init__.py", "VALUE = 7\n")
    return payload


def test_pack_then_install_waits_for_every_folder_then_unpacks_and_runs(tmp_path: Path) -> None:
    payload = _payload(tmp_path)
    carried = tmp_path / "carried"
    folders = b.pack(payload, carried, "k8s", folder_max=300)  # forces pieces and several folders
    assert len(folders) > 2 and all(
        (f / "install.sh").is_file() and (f / "bundle.py").is_file() for f in folders
    )
    cache, root = tmp_path / "cache", tmp_path / "root"

    # one call carries only the first folder: waiting, and it names what is still to carry
    only_first = tmp_path / "call1"
    only_first.mkdir()
    (only_first / folders[0].name).symlink_to(folders[0])
    assert b.install(only_first, cache, root) == b.EXIT_WAITING

    # a corrupt copy of a piece is not accepted
    victim = next(p for p in folders[1].iterdir() if ".part-" in p.name)
    good = victim.read_bytes()
    victim.write_bytes(b"x" + good[1:])
    assert b.install(carried, cache, root) == b.EXIT_WAITING
    victim.write_bytes(good)

    assert b.install(carried, cache, root) == 0
    tool = root / "bin" / "kube-apiserver"
    assert tool.read_bytes() == FAKE_TOOL and tool.stat().st_mode & 0o111
    assert (root / "site" / "demo_pkg" / "__init__.py").read_text() == "VALUE = 7\n"
    assert b.install(tmp_path / "nothing", cache, root) == 0  # idempotent: installed already


def test_a_broken_binary_fails_the_install_with_its_output(tmp_path: Path) -> None:
    payload = tmp_path / "payload"
    payload.mkdir()
    with lzma.open(payload / "etcd.xz", "wb", preset=0) as f:
        f.write(b"#!/bin/sh\necho 'GLIBC_2.99 not found' >&2\nexit 1\n")
    b.pack(payload, tmp_path / "carried", "k8s")
    with pytest.raises(b.BundleError, match="GLIBC_2.99"):
        b.install(tmp_path / "carried", tmp_path / "cache", tmp_path / "root")
