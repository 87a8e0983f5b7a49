#!/usr/bin/env bash
# Installs everything rewardplane needs on a fresh Debian machine (run as root or with sudo):
# a virtual environment (.venv) with the project and its dev extras, moto's own virtualenv (the
# tests' S3 server), and the real Kubernetes
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

# The workspace's distributions, editable, in one resolve (the root depends on the others by
# name). Package metadata states ranges; constraints/cpu.txt pins torch to the CPU build.
PACKAGES=(core sdk operator images/reward-server)
# Reinstall only when a dependency list or the constraints changed.
stamp=.venv/.rewardplane-deps
want="$(cat pyproject.toml constraints/cpu.txt "${PACKAGES[@]/%//pyproject.toml}" | sha256sum | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  log "installing python packages (constraints/cpu.txt: torch's CPU build)"
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  editable=()
  for p in "${PACKAGES[@]}"; do editable+=(-e "./$p"); done
  .venv/bin/python -m pip install -q -c constraints/cpu.txt "${editable[@]}" -e '.[dev]'
  echo "$want" > "$stamp"
fi

# The tests' S3-compatible server (moto) in a virtualenv of its own: its botocore needs
# python-dateutil<3, the kubernetes client in .venv needs >=3.
MOTO_VENV="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/moto-venv"
want="$(sha256sum constraints/moto.txt | cut -d' ' -f1)"
if [[ "$(cat "$MOTO_VENV/.rewardplane-deps" 2>/dev/null)" != "$want" ]]; then
  log "installing moto's server for the tests (constraints/moto.txt) in $MOTO_VENV"
  "$PY" -m venv "$MOTO_VENV"
  "$MOTO_VENV/bin/python" -m pip install -q -r constraints/moto.txt
  echo "$want" > "$MOTO_VENV/.rewardplane-deps"
fi

PYTHON=.venv/bin/python bash scripts/install-k8s-tools.sh
log "ready: .venv/bin/rewardplane, binaries in ${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin"
