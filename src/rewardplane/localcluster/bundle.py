"""Carry the local cluster to a machine without network: pack its binaries and wheels into folders
of bounded size (``pack``, on the CPU machine), verify and unpack them there (``install``).

The GPU machine is reached by calls that each carry at most ~64 MiB, so the bundle is split into
folders ``<prefix>1``, ``<prefix>2``... (big files in pieces), each with the same ``manifest.txt``
and a copy of this file. Every call that carries a folder runs ``install``: it copies the folder
into a cache that lasts while the machine stays warm, and once every file of the manifest is there
(sha256-checked) it rebuilds split files, decompresses the binaries (xz) into ``<root>/bin`` and
installs the wheels into ``<root>/site``. Exit status 0: installed (prints the exports); 3: files
still missing (names the folders to carry); 1: an error. Re-running it is cheap (idempotent).

Standard library only: on the GPU machine it runs before anything is installed.

Manifest lines: ``<sha256> <folder> <file>`` for a carried file, ``<sha256> = <file>`` for a file
rebuilt from its pieces ``<file>.part-NN``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import lzma
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.txt"
MIB = 1 << 20
DEFAULT_FOLDER_MAX = 48 * MIB  # one folder (~31 MiB today) per call, well inside the 64 MiB a call carries
PART = ".part-"
EXIT_WAITING = 3


class BundleError(RuntimeError):
    """The bundle is broken or cannot be installed; the message says what to do."""


# -- pure: planning the folders and the manifest ------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    sha256: str
    folder: str  # "=" for a file rebuilt from pieces
    name: str


@dataclass(frozen=True)
class Piece:
    source: str  # the whole file's name
    index: int  # piece number (-1: the whole file)
    offset: int
    size: int

    @property
    def name(self) -> str:
        return self.source if self.index < 0 else f"{self.source}{PART}{self.index:02d}"


def plan_folders(sizes: Mapping[str, int], folder_max: int, prefix: str) -> dict[str, list[Piece]]:
    """Folder name → the pieces it carries: files larger than ``folder_max`` are cut into pieces of
    at most ``folder_max``; pieces go first-fit, largest first, into ``prefix1``, ``prefix2``..."""
    if folder_max <= 0:
        raise BundleError(f"folder size limit must be positive, got {folder_max}")
    pieces: list[Piece] = []
    for name, size in sizes.items():
        if size <= folder_max:
            pieces.append(Piece(name, -1, 0, size))
            continue
        for i, off in enumerate(range(0, size, folder_max)):
            pieces.append(Piece(name, i, off, min(folder_max, size - off)))
    folders: list[tuple[int, list[Piece]]] = []  # (bytes used, pieces)
    for p in sorted(pieces, key=lambda p: (-p.size, p.name)):
        for k, (used, items) in enumerate(folders):
            if used + p.size <= folder_max:
                folders[k] = (used + p.size, [*items, p])
                break
        else:
            folders.append((p.size, [p]))
    return {f"{prefix}{k + 1}": sorted(items, key=lambda p: p.name) for k, (_, items) in enumerate(folders)}


def manifest_text(entries: Iterable[Entry], bundle_id: str) -> str:
    lines = [f"# rewardplane cluster bundle {bundle_id}"]
    lines += [f"{e.sha256} {e.folder} {e.name}" for e in sorted(entries, key=lambda e: (e.folder, e.name))]
    return "\n".join(lines) + "\n"


def parse_manifest(text: str) -> list[Entry]:
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{64}", parts[0]) or "/" in parts[2]:
            raise BundleError(f"{MANIFEST} line {n} is not '<sha256> <folder> <file>': {line!r}")
        entries.append(Entry(*parts))
    if not entries:
        raise BundleError(f"{MANIFEST} lists no files")
    return entries


def bundle_id_of(text: str) -> str:
    body = "".join(line + "\n" for line in text.splitlines() if line and not line.startswith("#"))
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def pieces_of(entries: list[Entry], whole: str) -> list[Entry]:
    return sorted((e for e in entries if e.name.startswith(whole + PART)), key=lambda e: e.name)


def missing_folders(entries: list[Entry], have: Callable[[Entry], bool]) -> list[str]:
    """Folders still to carry: those holding a file that is not in the cache with its sha256, unless
    the whole file it is a piece of was already rebuilt."""
    joined = {e.name: e for e in entries if e.folder == "="}
    missing: list[str] = []
    for e in entries:
        if e.folder == "=":
            continue
        whole = e.name.split(PART)[0] if PART in e.name else None
        if whole in joined and have(joined[whole]):
            continue
        if not have(e) and e.folder not in missing:
            missing.append(e.folder)
    return sorted(missing, key=lambda f: (len(f), f))


def dependency_closure(
    roots: Iterable[str], requires: Callable[[str], list[str]], present: Iterable[str]
) -> list[str]:
    """Distributions ``roots`` need (themselves included) that are not in ``present``; names are
    normalized (PEP 503). ``requires(name)`` gives a distribution's unconditional requirements."""
    have = {normalize(p) for p in present}
    seen: set[str] = set()
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in have:
            continue
        seen.add(name)
        todo += [normalize(r) for r in requires(name)]
    return sorted(seen)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def unconditional_requirements(dist: str) -> list[str]:
    """Requirement names of an installed distribution, without extras and marker-only ones that do
    not apply to CPython on Linux."""
    out = []
    for req in md.requires(dist) or []:
        spec, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        if marker.strip() and not _marker_holds(marker):
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        if m:
            out.append(m.group(1))
    return out


def _marker_holds(marker: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # keep it: one wheel too many is harmless
        return True
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"}
    env |= {"platform_system": "Linux", "platform_python_implementation": "CPython"}
    env |= {"implementation_name": "cpython", "platform_machine": "x86_64", "os_name": "posix"}
    return bool(Marker(marker).evaluate(env))


# -- I/O: packing (CPU machine) -------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def pack(payload: Path, dest: Path, prefix: str, folder_max: int = DEFAULT_FOLDER_MAX) -> list[Path]:
    """Split the files of ``payload`` into ``dest/<prefix>N`` folders, each with the manifest, this
    module and ``install.sh``; earlier folders of that prefix are replaced. Returns the folders."""
    files = sorted(p for p in payload.iterdir() if p.is_file())
    if not files:
        raise BundleError(f"nothing to pack in {payload}")
    plan = plan_folders({p.name: p.stat().st_size for p in files}, folder_max, prefix)
    for old in dest.glob(f"{prefix}[0-9]*"):
        if old.is_dir() and re.fullmatch(rf"{re.escape(prefix)}\d+", old.name):
            shutil.rmtree(old)
    entries: list[Entry] = []
    for folder, pieces in plan.items():
        (dest / folder).mkdir(parents=True)
        for p in pieces:
            out = dest / folder / p.name
            with open(payload / p.source, "rb") as src, open(out, "wb") as dst:
                src.seek(p.offset)
                dst.write(src.read(p.size))
            entries.append(Entry(sha256_of(out), folder, p.name))
            if p.index == 0:
                entries.append(Entry(sha256_of(payload / p.source), "=", p.source))
    body = manifest_text(entries, "")
    text = manifest_text(entries, bundle_id_of(body))
    script = Path(__file__).read_text()
    for folder in plan:
        (dest / folder / MANIFEST).write_text(text)
        (dest / folder / "bundle.py").write_text(script)
        (dest / folder / "install.sh").write_text(INSTALL_SH)
    return [dest / f for f in plan]


INSTALL_SH = """#!/usr/bin/env bash
# Run on the GPU machine, from the repo root, in every call that carries a folder of this bundle:
#     bash .whl/k8s1/install.sh      (exit 0: installed, prints the exports; 3: carry the rest)
# Env: K8S_ROOT (/tmp/k8s: bin/ and site/ go there), K8S_CACHE (/tmp/k8s-cache), PYTHON (python3).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/bundle.py" install --from "$(dirname "$here")" "$@"
"""


# -- I/O: installing (GPU machine) ----------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[cluster-bundle] {msg}", flush=True)


def install(carried_root: Path, cache: Path, root: Path, python: str = sys.executable) -> int:
    """Copy every carried folder of the bundle into ``cache``; once complete, unpack into ``root``.
    Returns 0 (installed), 3 (folders missing) or raises BundleError."""
    cache.mkdir(parents=True, exist_ok=True)
    manifests = sorted(carried_root.glob(f"*/{MANIFEST}"))
    texts = {m.parent.name: m.read_text() for m in manifests if (m.parent / "bundle.py").is_file()}
    ids = {bundle_id_of(t) for t in texts.values()}
    if len(ids) > 1:
        raise BundleError(
            f"{carried_root} holds folders of {len(ids)} bundles ({', '.join(sorted(ids))}): carry one"
        )
    for folder, text in texts.items():
        cached = cache / MANIFEST
        if cached.is_file() and bundle_id_of(cached.read_text()) != bundle_id_of(text):
            _log(f"bundle {bundle_id_of(text)} replaces the cached bundle {bundle_id_of(cached.read_text())}")
            shutil.rmtree(cache)
            cache.mkdir(parents=True)
        for f in (carried_root / folder).iterdir():
            if f.is_file():
                shutil.copyfile(f, cache / f.name)
        _log(f"carried {folder}")
    if not (cache / MANIFEST).is_file():
        _log("WAITING: no folder of the bundle carried yet")
        return EXIT_WAITING
    text = (cache / MANIFEST).read_text()
    bundle_id = bundle_id_of(text)
    done_mark = root / ".bundle_ok"
    if done_mark.is_file() and done_mark.read_text().strip() == bundle_id:
        _log(f"bundle {bundle_id} already installed in {root}")
        _print_exports(root)
        return 0
    entries = parse_manifest(text)
    sha_cache: dict[str, bool] = {}

    def have(e: Entry) -> bool:
        if e.name not in sha_cache:
            p = cache / e.name
            sha_cache[e.name] = p.is_file() and sha256_of(p) == e.sha256
        return sha_cache[e.name]

    missing = missing_folders(entries, have)
    if missing:
        all_folders = sorted({e.folder for e in entries if e.folder != "="}, key=lambda f: (len(f), f))
        _log(
            f"WAITING: bundle {bundle_id}: still to carry {', '.join(missing)} (of {', '.join(all_folders)})"
        )
        return EXIT_WAITING
    for whole in (e for e in entries if e.folder == "="):
        if have(whole):
            continue
        with open(cache / whole.name, "wb") as out:
            for piece in pieces_of(entries, whole.name):
                out.write((cache / piece.name).read_bytes())
        sha_cache.pop(whole.name, None)
        if not have(whole):
            raise BundleError(f"{whole.name} rebuilt from its pieces has the wrong sha256")
    names = {e.name.split(PART)[0] for e in entries if e.folder != "="}
    _unpack(cache, sorted(names), root, python)
    done_mark.write_text(bundle_id + "\n")
    _log(f"OK: bundle {bundle_id} installed in {root}")
    _print_exports(root)
    return 0


def _unpack(cache: Path, names: list[str], root: Path, python: str) -> None:
    bin_dir, site = root / "bin", root / "site"
    bin_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in names:
        if name.endswith(".xz"):
            target = bin_dir / name[: -len(".xz")]
            with lzma.open(cache / name) as src, open(f"{target}.tmp", "wb") as dst:
                shutil.copyfileobj(src, dst, MIB)
            os.chmod(f"{target}.tmp", 0o755)
            os.replace(f"{target}.tmp", target)
            _log(f"bin/{target.name}")
        elif name.endswith(".whl"):
            wheels.append(cache / name)
        else:
            _log(f"left in {cache}: {name}")
    if wheels:
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        for whl in wheels:  # a wheel is a zip: no pip needed, and nothing else in PYTHONPATH changes
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
        _log(f"{len(wheels)} wheels in {site}")
    for tool in sorted(bin_dir.iterdir()):
        done = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise BundleError(f"{tool} --version failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        _log(f"{tool.name}: {(done.stdout or done.stderr).strip().splitlines()[0]}")
    if shutil.which("openssl") is None:  # the control plane makes its service-account key with it
        _log("WARNING: no openssl on PATH: the control plane needs it (or the Python package cryptography)")


def _print_exports(root: Path) -> None:
    print(
        f"export REWARDPLANE_CACHE={root} PATH={root}/bin:$PATH "
        f"PYTHONPATH=$PYTHONPATH${{PYTHONPATH:+:}}{root}/site",
        flush=True,
    )


# -- CLI -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bundle.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="CPU machine: split PAYLOAD into DEST/PREFIXn folders")
    pk.add_argument("payload", type=Path)
    pk.add_argument("--dest", type=Path, default=Path(".whl"))
    pk.add_argument("--prefix", default="k8s")
    pk.add_argument("--folder-max-mib", type=float, default=DEFAULT_FOLDER_MAX / MIB)
    wh = sub.add_parser("wheels", help="print NAME==VERSION of ROOTS' dependencies missing on the target")
    wh.add_argument("roots", nargs="+")
    wh.add_argument("--present", type=Path, required=True, help="file: distributions the target has")
    ins = sub.add_parser("install", help="GPU machine: verify and unpack the carried folders")
    ins.add_argument("--from", dest="carried", type=Path, default=Path(".whl"))
    ins.add_argument("--cache", type=Path, default=Path(os.environ.get("K8S_CACHE", "/tmp/k8s-cache")))
    ins.add_argument("--root", type=Path, default=Path(os.environ.get("K8S_ROOT", "/tmp/k8s")))
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            for folder in pack(args.payload, args.dest, args.prefix, int(args.folder_max_mib * MIB)):
                size = sum(f.stat().st_size for f in folder.iterdir())
                print(f"{folder}\t{size / MIB:.1f} MiB")
            return 0
        if args.cmd == "wheels":
            lines = [ln for ln in args.present.read_text().splitlines() if not ln.startswith("#")]
            present = " ".join(lines).split()
            for name in dependency_closure(args.roots, unconditional_requirements, present):
                print(f"{name}=={md.version(name)}")
            return 0
        return install(args.carried, args.cache, args.root)
    except (BundleError, OSError, subprocess.SubprocessError, md.PackageNotFoundError) as exc:
        print(f"[cluster-bundle] ERROR: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
