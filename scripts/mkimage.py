#!/usr/bin/env python3
"""Wrap one uncompressed layer tarball into a docker-archive image (manifest.json, config, layer).

The result loads with ``docker load`` and ``ctr images import``; scripts/build-images.sh uses it
for the pause image and the debootstrap base image, which are made without any registry.

usage: mkimage.py --layer layer.tar --tag localhost/x:1 --out image.tar [--entrypoint ...] [--cmd ...]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile

DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def add_bytes(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tf.addfile(info, io.BytesIO(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", nargs="*")
    ap.add_argument("--cmd", nargs="*")
    ap.add_argument("--env", action="append", default=[DEFAULT_PATH])
    a = ap.parse_args()

    diff_id = sha256_file(a.layer)
    cfg: dict[str, object] = {"Env": a.env, "WorkingDir": "/"}
    if a.entrypoint:
        cfg["Entrypoint"] = a.entrypoint
    if a.cmd:
        cfg["Cmd"] = a.cmd
    config = {
        "architecture": "amd64",
        "os": "linux",
        # A fixed date keeps the image id a function of the layer alone (reproducible).
        "created": "1970-01-01T00:00:00Z",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff_id]},
        "history": [{"created_by": "mkimage.py " + os.path.basename(a.layer)}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_id = hashlib.sha256(config_bytes).hexdigest()
    manifest = [{"Config": config_id + ".json", "RepoTags": [a.tag], "Layers": [diff_id + "/layer.tar"]}]
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tf:
        add_bytes(tf, config_id + ".json", config_bytes)
        info = tf.gettarinfo(a.layer, arcname=diff_id + "/layer.tar")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o644
        with open(a.layer, "rb") as f:
            tf.addfile(info, f)
        add_bytes(tf, "manifest.json", json.dumps(manifest).encode())
    os.replace(tmp, a.out)
    print(f"{a.out}: {a.tag} (config sha256:{config_id[:12]})")


if __name__ == "__main__":
    main()
