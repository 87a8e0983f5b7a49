"""The node agent: a stand-in for the kubelet that runs Pods as local processes.

It registers a Node (capacity incl. ``nvidia.com/gpu``), keeps it Ready with heartbeats, and
watches Pods bound to it (``spec.nodeName``; there is no scheduler, the operator binds pods
itself). For each pod it:

- gives the pod its own loopback address 127.N.0.x (x from 2 up; N: ``--pod-network``, 0 by
  default) as ``status.podIP``;
- writes Secret / ConfigMap volumes into a per-pod directory and rewrites each volumeMount's
  ``mountPath`` prefix in command, args and env values to that directory (there is no mount
  namespace: the process sees the host's filesystem);
- hands out GPUs (:mod:`..gpus`): whole devices for ``nvidia.com/gpu`` requests, none that a
  shared-mode pod pins with its own ``CUDA_VISIBLE_DEVICES``; pods pinning one device start one at
  a time (vLLM measures the device's free memory while it starts);
- runs the first container's ``command`` + ``args`` (``$(VAR)`` expanded; ``python``/``python3``
  become the agent's own interpreter) in its own process group, output to a per-pod log file;
- reports status through the status subresource: phase, podIP, containerStatuses, conditions,
  Ready only once the readinessProbe passes; restarts crashed processes with the kubelet's
  back-off (:mod:`..backoff`: CrashLoopBackOff, the log's tail as the cause);
- on deletion stops the process (SIGTERM, SIGKILL after the grace period) and deletes the Pod
  with gracePeriodSeconds=0, as the kubelet does.


Pure logic lives in :mod:`..podspec`, :mod:`..probes`, :mod:`..gpus` and :mod:`..backoff`, and
here in :mod:`.node_object` and :mod:`.launch`; the rest is the I/O around it:

- :mod:`.config`: the agent's settings and timings;
- :mod:`.agent`: :class:`NodeAgent`, the watch, the node's addresses and GPUs;
- :mod:`.registration`: the Node object's registration and heartbeat;
- :mod:`.podworker`: :class:`PodWorker`, one pod from start to deletion;
- :mod:`.processes` and :mod:`.volumes`: a pod's process and volumes on the host;
- :mod:`.cli`: ``rewardplane node``.

Run it as ``rewardplane node`` or ``python -m rewardplane.localcluster.nodeagent``.
"""

from rewardplane.localcluster.nodeagent.agent import NodeAgent
from rewardplane.localcluster.nodeagent.cli import build_parser, main, parse_labels
from rewardplane.localcluster.nodeagent.config import MARKER_ENV, POD_NETWORK_ENV, AgentConfig, detect_memory
from rewardplane.localcluster.nodeagent.node_object import node_object, node_status
from rewardplane.localcluster.nodeagent.podworker import PodWorker
from rewardplane.localcluster.nodeagent.processes import kill_group, kill_leftovers

__all__ = [
    "MARKER_ENV",
    "POD_NETWORK_ENV",
    "AgentConfig",
    "NodeAgent",
    "PodWorker",
    "build_parser",
    "detect_memory",
    "kill_group",
    "kill_leftovers",
    "main",
    "node_object",
    "node_status",
    "parse_labels",
]
