#!/usr/bin/env bash
# Runs the GPU suite and benchmarks on a GPU machine without network (the project's `device`
# machines: Python 3.12, torch + transformers installed, our other dependencies carried as wheels).
#
#   bash scripts/gpu-run.sh tests [PYTEST ARGS]   # tests/gpu (NCCL sync; vLLM tests when vllm imports),
#                                                 # or the test files / options given
#   bash scripts/gpu-run.sh bench-sync [ARGS]     # benchmarks/weight_sync.py
#   bash scripts/gpu-run.sh bench-sharded [ARGS]  # benchmarks/sharded_push.py (4 GPUs)
#   bash scripts/gpu-run.sh bench-score [ARGS]    # benchmarks/scoring_gpu.py; without ARGS the figures'
#                                                 # run: every size and the judge, interleaved, 5 rounds
#   bash scripts/gpu-run.sh bench-pending         # benchmarks/pending_receive.py (2 GPUs)
#   bash scripts/gpu-run.sh bench-http [ARGS]     # benchmarks/http_client.py (CPU only)
#   bash scripts/gpu-run.sh bench-sleep [ARGS]    # benchmarks/sleep_wake.py (1 GPU, ~5 min)
#   bash scripts/gpu-run.sh bench-colocated [ARGS] # benchmarks/colocated_push.py (1 GPU; --quick: 0.4B)
#   bash scripts/gpu-run.sh bench NAME [ARGS]     # benchmarks/NAME.py, log in $OUT/bench-NAME.log
#   bash scripts/gpu-run.sh all
#
# Wheels: vLLM and its dependencies (uvicorn and tenacity included) come with ../shared/device's
# bundle (see docs/gpu.md), installed in /tmp/site; without that bundle, `bash scripts/gpu-wheels.sh`
# (CPU machine) fills .whl/proj with our server's wheels, installed here into /tmp/site.
# Logs go to $OUT if set. For runs longer than one device call, see scripts/gpu-bg.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/rewardplane-out}; mkdir -p "$OUT"
if [ ! -f /tmp/site/.vllm_bundle_ok ] && compgen -G ".whl/proj/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/proj/*.whl
fi
# Every distribution's source root on the path: `rewardplane` is a namespace package, so no build
# step is needed (several runs can share a machine).
SRC=$ROOT/core/src:$ROOT/sdk/src:$ROOT/operator/src:$ROOT/images/reward-server/src:$ROOT/src
export PYTHONPATH=/tmp/site:$SRC:$ROOT${PYTHONPATH:+:$PYTHONPATH}
# CUDA_DEVICE_ORDER: device numbers as nvidia-smi's (the node agent's pods use them too).
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
# The local cluster's binaries and the operator's wheels, where the cluster bundle was installed
# (bash .whl/k8s1/install.sh; docs/gpu.md, "The operator on real GPUs").
K8S_ROOT=${K8S_ROOT:-/tmp/k8s}
if [ -f "$K8S_ROOT/.bundle_ok" ]; then
  export REWARDPLANE_CACHE=$K8S_ROOT PATH=$K8S_ROOT/bin:$PATH PYTHONPATH=$PYTHONPATH:$K8S_ROOT/site
fi
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L || true
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}"
what=${1:-all}; shift || true
case "$what" in
  tests) [ $# -gt 0 ] || set -- tests/gpu  # default: the whole GPU suite; or name test files / -k
    python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" "$@" 2>&1 | tee "$OUT/gpu-tests.log" ;;
  bench-sync) python3 benchmarks/weight_sync.py "$@" 2>&1 | tee "$OUT/bench-sync.log" ;;
  bench-sharded) python3 benchmarks/sharded_push.py "$@" 2>&1 | tee "$OUT/bench-sharded.log" ;;
  bench-score) [ $# -gt 0 ] || set -- --sizes 0.4b,1.4b,7b --judge-sizes 0.4b --interleave --phase-timeout 540
    python3 benchmarks/scoring_gpu.py "$@" 2>&1 | tee "$OUT/bench-score.log" ;;
  bench-pending) python3 benchmarks/pending_receive.py "$@" 2>&1 | tee "$OUT/bench-pending.log" ;;
  bench-http) python3 benchmarks/http_client.py "$@" 2>&1 | tee "$OUT/bench-http.log" ;;
  bench-sleep) [ $# -gt 0 ] || set -- --out "$OUT/sleep_wake.json"
    python3 benchmarks/sleep_wake.py "$@" 2>&1 | tee "$OUT/bench-sleep.log" ;;
  bench-colocated) python3 benchmarks/colocated_push.py "$@" 2>&1 | tee "$OUT/bench-colocated.log" ;;
  bench) name=${1:?usage: gpu-run.sh bench NAME [ARGS]}; shift
    python3 "benchmarks/$name.py" "$@" 2>&1 | tee "$OUT/bench-$name.log" ;;
  all)
    python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" tests/gpu 2>&1 | tee "$OUT/gpu-tests.log"
    python3 benchmarks/weight_sync.py 2>&1 | tee "$OUT/bench-sync.log" ;;
  *) echo "usage: gpu-run.sh tests|bench-sync|bench-sharded|bench-score|bench-pending|bench-http|bench-sleep|bench-colocated|bench NAME|all [args]"; exit 2 ;;
esac
