#!/usr/bin/env bash
# The main job: bring up the local development cluster — a real single-node Kubernetes (kubelet,
# containerd, CNI, kube-proxy, control plane) running the images built from this repository, with
# the operator installed by the Helm chart — apply the example RewardModel (a tiny reward model on
# CPU), score through the SDK, push new weights through the operator, and show `kubectl get rm` /
# `kubectl get ws`. The cluster stays up afterwards; stop it with: .venv/bin/rewardplane dev down
# (REWARDPLANE_NODE_MODE=agent runs the same walk-through on the node agent instead: pods as host processes.)
set -euo pipefail
cd "$(dirname "$0")/.."
NODE="${REWARDPLANE_NODE_MODE:-real}"
bash scripts/setup.sh
[[ "$NODE" == real ]] && bash scripts/build-images.sh
export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PWD/.venv/bin:$PATH"

python examples/make_tiny_model.py --out /tmp/rewardplane-tiny-rm >/dev/null
# Pushed weights persist here (a hostPath): with persistDir the server runs as root in its container.
install -d -m 0755 -o 0 -g 0 /tmp/rewardplane-weights
eval "$(rewardplane dev up --node "$NODE")"
echo "KUBECONFIG=$KUBECONFIG"
# start from version 0 on every run (a cluster that is still up keeps its objects)
kubectl delete -f examples/rewardmodel.yaml --ignore-not-found --wait=true --timeout=120s
kubectl apply -f examples/rewardmodel.yaml
# Bounded, and saying what it waits for: the RewardModel's phase and message every 10 s; on a
# timeout, its conditions and events (they name the cause, e.g. a crash-looping server's error).
for i in $(seq 1 30); do
  kubectl wait --for=condition=Available rewardmodel/tiny-rm --timeout=10s >/dev/null 2>&1 && break
  echo "waiting for tiny-rm to be Available: $(kubectl get rm tiny-rm -o jsonpath='{.status.phase}: {.status.message}')"
  if [[ $i -eq 30 ]]; then
    echo "tiny-rm is not Available after 300 s:" >&2
    kubectl describe rm tiny-rm | tail -n 25 >&2
    exit 1
  fi
done
kubectl get rm
python examples/cluster_demo.py --name tiny-rm
kubectl get rm
kubectl get ws
kubectl get pods -o wide
# Printed so that they work as printed in a new shell: the tools are not on the user's PATH.
cat <<MSG

The local cluster is still running. In your shell:
  export KUBECONFIG=$KUBECONFIG
  export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PWD/.venv/bin:\$PATH"   # kubectl, helm, rewardplane
  kubectl get rm,ws,pods
  rewardplane status tiny-rm
  kubectl logs tiny-rm-0      # a server's log (kubectl logs works on the real node)
  rewardplane dev down --node $NODE        # stop it (leaves nothing behind)
MSG
