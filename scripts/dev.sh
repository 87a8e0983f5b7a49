#!/usr/bin/env bash
# The main job: bring up the local development cluster (real kube-apiserver + etcd, the node agent,
# the operator), apply the example RewardModel (a tiny reward model on CPU), score through the SDK,
# push new weights through the operator, and show `kubectl get rm` / `kubectl get ws`.
# The cluster stays up afterwards; stop it with: .venv/bin/rewardplane dev down
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PWD/.venv/bin:$PATH"

python examples/make_tiny_model.py --out /tmp/rewardplane-tiny-rm >/dev/null
eval "$(rewardplane dev up)"
echo "KUBECONFIG=$KUBECONFIG"
# start from version 0 on every run (a cluster left up by an earlier run keeps its objects)
kubectl delete -f examples/rewardmodel.yaml --ignore-not-found --wait=true --timeout=120s
kubectl apply -f examples/rewardmodel.yaml
kubectl wait --for=condition=Available rewardmodel/tiny-rm --timeout=300s
kubectl get rm
python examples/cluster_demo.py --name tiny-rm
kubectl get rm
kubectl get ws
# Printed so that they work as printed in a new shell: the tools are not on the user's PATH.
cat <<MSG

The local cluster is still running. In your shell:
  export KUBECONFIG=$KUBECONFIG
  export PATH="${REWARDPLANE_CACHE:-$HOME/.cache/rewardplane}/bin:$PWD/.venv/bin:\$PATH"   # kubectl, helm, rewardplane
  kubectl get rm,ws,pods
  rewardplane status tiny-rm
  ls $HOME/.cache/rewardplane/dev/node/pods/default_tiny-rm-0_*/reward-server.log   # a server's log
  rewardplane dev down        # stop it
MSG
