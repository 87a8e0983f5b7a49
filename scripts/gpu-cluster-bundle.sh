#!/usr/bin/env bash
# gpu-cluster-bundle.sh [DEST]   (CPU machine, repo root; DEST defaults to .whl, git-ignored)
#
# Packs what the local cluster (`rewardplane dev up --node agent`) needs on the GPU machine, which
# has no network and no Kubernetes: kube-apiserver and etcd (xz) and the wheels of the operator and
# the node agent that the machine lacks (kopf, kubernetes and their dependencies, at the versions of
# this checkout's .venv; scripts/gpu-machine-packages.txt lists what the machine has). Output:
# DEST/k8s1, DEST/k8s2 ... (each at most FOLDER_MAX_MIB, default 48; today one folder of ~31 MiB, carried in a call
# of its own), each with manifest.txt (sha256), bundle.py and install.sh.
# On the GPU machine, in each call that carries a folder:  bash .whl/k8sN/install.sh
# (exit 3 until every folder was carried; then it prints the exports). See docs/gpu.md.
#
# Env: PYTHON (.venv/bin/python), FOLDER_MAX_MIB (48), XZ_LEVEL (9).
set -euo pipefail
export LC_ALL=C
DEST=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
FOLDER_MAX_MIB=${FOLDER_MAX_MIB:-48}
XZ_LEVEL=${XZ_LEVEL:-9}
WORK=$DEST/k8s-build            # kept between runs: compressed binaries and wheels are reused
PAYLOAD=$WORK/payload
log() { printf '[gpu-cluster-bundle] %s\n' "$*"; }
die() { printf '[gpu-cluster-bundle] ERROR: %s\n' "$*" >&2; exit 1; }

[ -x "$PY" ] || die "$PY not found: run scripts/setup.sh first (or set PYTHON)"
command -v xz >/dev/null || die "xz not found: apt-get install xz-utils"
mkdir -p "$PAYLOAD" "$WORK/wheels"
git check-ignore -q "$DEST/x" 2>/dev/null || die "$DEST is not git-ignored: it would travel as part of the tree"

# 1. the binaries, compressed once per source binary
for name in kube-apiserver etcd; do
    src=$("$PY" -c "from rewardplane.localcluster.binaries import find_binary; print(find_binary('$name'))") \
        || die "$name not found (scripts/install-k8s-tools.sh installs it)"
    sha=$(sha256sum "$src" | cut -d' ' -f1)
    if [ "$(cat "$WORK/$name.src-sha256" 2>/dev/null)" != "$sha" ] || [ ! -f "$PAYLOAD/$name.xz" ]; then
        log "compressing $src ($(du -h "$src" | cut -f1)) with xz -$XZ_LEVEL"
        xz -"$XZ_LEVEL" -T0 -c "$src" > "$PAYLOAD/$name.xz.tmp"
        mv -f "$PAYLOAD/$name.xz.tmp" "$PAYLOAD/$name.xz"
        echo "$sha" > "$WORK/$name.src-sha256"
    fi
    log "$name: $("$src" --version 2>&1 | head -n1) -> $(du -h "$PAYLOAD/$name.xz" | cut -f1)"
done

# 2. the wheels the machine lacks, at this checkout's versions
mapfile -t wanted < <("$PY" -m rewardplane.localcluster.bundle wheels kopf kubernetes \
    --present scripts/gpu-machine-packages.txt)
[ ${#wanted[@]} -gt 0 ] || die "no wheels computed (is the operator installed in $PY's environment?)"
log "wheels: ${wanted[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$WORK/wheels" "${wanted[@]}" || die "pip download failed"
rm -f "$PAYLOAD"/*.whl
for req in "${wanted[@]}"; do
    dist=${req%%==*}; ver=${req#*==}
    pat=$(echo "$dist" | tr '-' '_')
    whl=$(ls "$WORK/wheels" | grep -i "^${pat}-${ver}-.*\.whl$" | head -n1) || true
    [ -n "$whl" ] || die "no wheel for $req in $WORK/wheels"
    cp -f "$WORK/wheels/$whl" "$PAYLOAD/"
done

# 3. the folders
"$PY" -m rewardplane.localcluster.bundle pack "$PAYLOAD" --dest "$DEST" --prefix k8s \
    --folder-max-mib "$FOLDER_MAX_MIB"
log "payload $(du -sh "$PAYLOAD" | cut -f1) in $(ls -d "$DEST"/k8s[0-9]* | wc -l) folder(s); carry each once:"
for d in "$DEST"/k8s[0-9]*; do log "  $d  $(du -sh "$d" | cut -f1)   bash $d/install.sh"; done
