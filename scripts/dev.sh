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
# The server runs as uid 65532 in its container and persists pushed weights here (a hostPath).
install -d -m 0755 -o 65532 -g 65532 /tmp/rewardplane-weights
eval "$(rewardplane dev up --node "$NODE")"
echo "KUBECONFIG=$KUBECONFIG"
# start from version 0 on every run (a cluster left up by an earlier run keeps its objects)
kubectl delete -f examples/rewardmodel.yaml --ignore-not-found --wait=true --timeout=120s
kubectl apply -f examples/rewardmodel.yaml
kubectl wait --for=condition=Available rewardmodel/tiny-rm --timeout=300s
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
