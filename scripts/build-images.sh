#!/usr/bin/env bash
# Builds rewardplane's images on this machine, with no registry: the one documented command.
#
#   bash scripts/build-images.sh            # operator, reward-server (+ the e2e trainer image)
#
# What it does, each step cached under ${REWARDPLANE_CACHE:-~/.cache/rewardplane}:
#   1. base/     a Debian bookworm base with python3, python3-venv and tini, from debootstrap
#                (used as BASE_IMAGE instead of the online defaults python:3.11-slim / vLLM);
#   2. images/pause.tar   the pod sandbox image: pause.c from Debian's kubernetes source, static;
#   3. wheelhouse/        every Python wheel the images install (CPU torch included), filled on
#                the host with `pip download`, so that no build step needs the network;
#   4. images/{operator,reward-server,trainer}.tar   `docker build --network none` of
#                Dockerfile and images/reward-server/Dockerfile by a dockerd started here (own
#                data root and socket under the cache, stopped by pid when done), then `docker save`.
# `rewardplane dev up --node real` imports images/*.tar into the node's containerd.
#
# Env: REWARDPLANE_IMAGE_TAG (default: the project version + "-local"), DOCKER (default /usr/bin/docker).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

CACHE="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}"
IMAGES="$CACHE/images"
BASE_DIR="$CACHE/base"
WHEELHOUSE="$CACHE/wheelhouse"
RUN="$CACHE/docker"
DOCKER="${DOCKER:-/usr/bin/docker}"   # /usr/local/bin/docker may be a newer CLI than Debian's daemon
PY="${PYTHON:-$ROOT/.venv/bin/python}"
BASE_TAG="localhost/rewardplane/debian-python:bookworm"
PAUSE_TAG="localhost/rewardplane/pause:3.4.1"
TAG="${REWARDPLANE_IMAGE_TAG:-$("$PY" -c 'import importlib.metadata as m; print(m.version("rewardplane"))')-local}"
mkdir -p "$IMAGES" "$BASE_DIR" "$WHEELHOUSE" "$RUN"

log() { printf '[build-images %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[[ "$(id -u)" -eq 0 ]] || die "run as root: debootstrap and dockerd need it"
for tool in debootstrap gcc dockerd "$DOCKER"; do
  command -v "$tool" >/dev/null || die "$tool missing: run scripts/install-k8s-tools.sh (it installs docker.io, debootstrap, gcc)"
done

# One build at a time per cache (worktrees share it).
exec 8>"$CACHE/.images.lock"
flock -w 3600 8 || die "timed out waiting for another image build ($CACHE/.images.lock)"

# ---------------------------------------------------------------------------------------------
# 1. base image: debootstrap (minbase) + python3, venv support and tini (the init that forwards
#    signals to the server: a python PID 1 without handlers ignores SIGTERM).
# ---------------------------------------------------------------------------------------------
if [[ ! -f "$BASE_DIR/base.tar" ]]; then
  log "debootstrap bookworm (about 80 s)"
  rm -rf "$BASE_DIR/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,tini,ca-certificates bookworm \
    "$BASE_DIR/rootfs" http://deb.debian.org/debian >"$BASE_DIR/debootstrap.log" 2>&1 \
    || { tail -n 20 "$BASE_DIR/debootstrap.log" >&2; die "debootstrap failed (log: $BASE_DIR/debootstrap.log)"; }
  rm -rf "$BASE_DIR/rootfs/var/cache/apt/archives/"*.deb "$BASE_DIR/rootfs/var/lib/apt/lists/"*
  tar --numeric-owner --xattrs -C "$BASE_DIR/rootfs" --exclude='./dev/*' --exclude='./proc/*' \
    --exclude='./sys/*' -cf "$BASE_DIR/layer.tar" .
  python3 scripts/mkimage.py --layer "$BASE_DIR/layer.tar" --tag "$BASE_TAG" --out "$BASE_DIR/base.tar" --cmd /bin/bash
  rm -rf "$BASE_DIR/rootfs" "$BASE_DIR/layer.tar"
fi

# ---------------------------------------------------------------------------------------------
# 2. pause image, from the kubernetes source tarball that install-k8s-tools.sh downloaded
# ---------------------------------------------------------------------------------------------
if [[ ! -f "$IMAGES/pause.tar" ]]; then
  ORIG="$(ls "$CACHE"/build/kubernetes-src/kubernetes_*.orig.tar.* 2>/dev/null | head -n 1 || true)"
  [[ -n "$ORIG" ]] || die "no kubernetes source tarball under $CACHE/build/kubernetes-src: run scripts/install-k8s-tools.sh"
  P="$(mktemp -d)"
  tar -xf "$ORIG" -C "$P" --wildcards '*/build/pause/linux/pause.c'
  mkdir -p "$P/layer"
  gcc -Os -Wall -Werror -static -DVERSION=v3.4.1-rewardplane -o "$P/layer/pause" "$P"/*/build/pause/linux/pause.c
  strip "$P/layer/pause"
  tar --numeric-owner --owner=0 --group=0 --mtime=@0 -C "$P/layer" -cf "$P/layer.tar" ./pause
  python3 scripts/mkimage.py --layer "$P/layer.tar" --tag "$PAUSE_TAG" --out "$IMAGES/pause.tar" --entrypoint /pause
  rm -rf "$P"
fi

# ---------------------------------------------------------------------------------------------
# 3. wheelhouse: every pinned wheel of images/constraints.txt (the build backend included) and
#    the CPU torch, for the base's Python (3.11), so the image builds install with --no-index.
# ---------------------------------------------------------------------------------------------
log "wheelhouse: pip download (cached in $WHEELHOUSE)"
"$PY" -m pip download -q --no-deps --dest "$WHEELHOUSE" --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform linux_x86_64 --platform any --implementation cp \
  -r images/constraints.txt "torch==2.13.0" >"$CACHE/wheelhouse.log" 2>&1 \
  || { grep -v '^WARNING' "$CACHE/wheelhouse.log" | tail -n 20 >&2
       die "pip download failed (log: $CACHE/wheelhouse.log): the wheelhouse is filled on the host, so PyPI (or its mirror) must be reachable"; }
# The build context carries the wheelhouse as hard links (same filesystem) or copies.
rm -rf .wheelhouse
cp -al "$WHEELHOUSE" .wheelhouse 2>/dev/null || cp -a "$WHEELHOUSE" .wheelhouse
trap 'rm -rf "$ROOT/.wheelhouse"' EXIT

# ---------------------------------------------------------------------------------------------
# 4. dockerd of our own (no bridge, no iptables: builds run with --network none), build, save
# ---------------------------------------------------------------------------------------------
SOCK="$RUN/docker.sock"
export DOCKER_HOST="unix://$SOCK"
stop_dockerd() {
  local pid
  pid="$(cat "$RUN/dockerd.pid" 2>/dev/null || true)"
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$RUN/dockerd.pid"
  # dockerd's own containerd mounts nothing once stopped; its exec root holds only sockets.
  rm -rf "$RUN/exec"
}
trap 'stop_dockerd; rm -rf "$ROOT/.wheelhouse"' EXIT
stop_dockerd
log "starting dockerd (data root $RUN/data)"
dockerd -H "$DOCKER_HOST" --data-root "$RUN/data" --exec-root "$RUN/exec" --pidfile "$RUN/dockerd.pidfile" \
  --bridge=none --iptables=false --ip-masq=false --ip-forward=false \
  >"$RUN/dockerd.log" 2>&1 &
echo $! >"$RUN/dockerd.pid"
for _ in $(seq 1 150); do "$DOCKER" version >/dev/null 2>&1 && break; sleep 0.2; done
"$DOCKER" version >/dev/null 2>&1 || { tail -n 20 "$RUN/dockerd.log" >&2; die "dockerd did not start (log: $RUN/dockerd.log)"; }

"$DOCKER" image inspect "$BASE_TAG" >/dev/null 2>&1 || "$DOCKER" load -q -i "$BASE_DIR/base.tar" >/dev/null

build() { # name target dockerfile
  local name=$1 target=$2 file=$3 start=$SECONDS
  log "docker build $name ($file, target $target)"
  DOCKER_BUILDKIT=0 "$DOCKER" build -q --network none -f "$file" --target "$target" \
    --build-arg BASE_IMAGE="$BASE_TAG" --build-arg TORCH_REQUIREMENT="torch==2.13.0" \
    --build-arg PIP_INSTALL_ARGS="--no-index --find-links /wheelhouse -c /wheelhouse/constraints.txt" \
    -t "localhost/rewardplane/$name:$TAG" . >/dev/null \
    || die "docker build of $name failed (rerun without -q to see why: DOCKER_HOST=$DOCKER_HOST $DOCKER build -f $file .)"
  local id
  id="$("$DOCKER" image inspect -f '{{.Id}}' "localhost/rewardplane/$name:$TAG")"
  # An unchanged image keeps its tarball (and its mtime, so the node does not import it again).
  if [[ -f "$IMAGES/$name.tar" && "$(cat "$IMAGES/$name.id" 2>/dev/null)" == "$id" ]]; then
    log "$name: unchanged ($id)"
    return
  fi
  "$DOCKER" save "localhost/rewardplane/$name:$TAG" -o "$IMAGES/$name.tar.tmp"
  mv "$IMAGES/$name.tar.tmp" "$IMAGES/$name.tar"
  echo "$id" >"$IMAGES/$name.id"
  log "$name: localhost/rewardplane/$name:$TAG in $((SECONDS - start)) s -> $IMAGES/$name.tar"
}
build operator operator Dockerfile
build reward-server reward-server images/reward-server/Dockerfile
build trainer trainer images/reward-server/Dockerfile
# (No `docker image prune`: the untagged build stages are the layer cache that makes a rebuild
# after a code change take seconds. `rm -rf ~/.cache/rewardplane/docker` reclaims the space.)
echo "$TAG" >"$IMAGES/TAG"
log "done: images in $IMAGES (tag $TAG)"
