#!/usr/bin/env bash
# Installs everything rewardplane needs on a fresh Debian machine (run as root or with sudo):
# a virtual environment (.venv) with the project and its dev extras, and the real Kubernetes
# parts (etcd, kube-apiserver, kubectl, helm) through scripts/install-k8s-tools.sh.
# Idempotent and cached: a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
SUDO=""; [[ "$(id -u)" -eq 0 ]] || SUDO="sudo"

PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null || ! "$PY" -c 'import venv, ensurepip' 2>/dev/null; then
  log "installing python3 and venv from Debian"
  $SUDO apt-get update -q && $SUDO apt-get install -y -q python3 python3-venv python3-dev
  PY=python3
fi
[[ -x .venv/bin/python ]] || { log "creating .venv"; "$PY" -m venv .venv; }

# Reinstall only when the dependency list changed.
stamp=.venv/.rewardplane-deps
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  log "installing python packages (torch is pinned to the CPU build 2.13.0)"
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi

PYTHON=.venv/bin/python bash scripts/install-k8s-tools.sh
log "ready: .venv/bin/rewardplane, binaries in ${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin"
