"""A pod's volumes on the host: Secret and ConfigMap keys written as files into the pod's own
directory, reached by the pod's processes through a short link.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from rewardplane.localcluster.podspec import VolumePlan

log = logging.getLogger("rewardplane.nodeagent")

# Unix socket paths are limited to 107 bytes (sockaddr_un); programs put sockets under $TMPDIR
# (vLLM: ``ipc://$TMPDIR/<uuid>``, 43 bytes of it). A pod's emptyDir under a long state directory
# leaves no room, so the node agent reaches the per-pod volumes through a short link instead.
SHORT_LINK_PREFIX = "rp-"


def short_link_path(pod_uid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{SHORT_LINK_PREFIX}{pod_uid.replace('-', '')[:12]}"


def short_volumes_link(pod_uid: str, target: Path) -> Path:
    """A short symlink (``<tmp>/rp-<uid>``) to ``target`` (the pod's volumes directory), made or
    refreshed here; the pod's processes see its volumes through it. ``remove_short_link`` drops it."""
    link = short_link_path(pod_uid)
    target.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        if Path(os.readlink(link)) == target:
            return link
        link.unlink()
    elif link.exists():  # not ours: keep the long path rather than touch it
        log.warning("%s exists and is not a link; pod volumes keep their long path %s", link, target)
        return target
    link.symlink_to(target, target_is_directory=True)
    return link


def remove_short_link(link: Path) -> None:
    if link.is_symlink():
        link.unlink(missing_ok=True)


def write_volumes(volumes: Iterable[VolumePlan], per_pod_dir: Path) -> None:
    """Create each volume's directory and (re)write Secret/ConfigMap keys as files; the pod's own
    (under ``per_pod_dir``) are private to it."""
    for vol in volumes:
        if vol.files or vol.directory.is_relative_to(per_pod_dir):
            if vol.files:
                shutil.rmtree(vol.directory, ignore_errors=True)  # keys removed upstream vanish
            vol.directory.mkdir(parents=True, exist_ok=True)
            vol.directory.chmod(0o700)
        else:
            vol.directory.mkdir(parents=True, exist_ok=True)
        for rel, data in vol.files.items():
            target = vol.directory / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            target.chmod(vol.mode)
