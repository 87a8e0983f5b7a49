"""Weight pushes from a trainer into reward servers: one flow, in three parts.

- ``plan``: what a push sends. ``plan.checks`` normalises the names and validates them for the
  training mode and the served manifest; ``plan.layout`` describes what each rank of a sharded
  trainer holds and who sends which bytes; ``plan.delta`` picks the tensors that changed since the
  last acknowledged push; ``plan.slices`` reads what tensor-parallel replicas keep of a layout.
- ``wire``: how a push is started and agreed. ``wire.http`` announces it over the servers' HTTP
  control plane and broadcasts the buckets; ``wire.data_plane`` starts a known layout with a header
  in the group's store instead; ``wire.operator`` asks the operator through a ``WeightSync``.
- ``ranks``: who sends. One trainer process sends everything (``wire.http``, ``wire.operator``);
  ``ranks.sharded`` (direct) and ``ranks.operator`` (through the operator) send from every rank of
  a multi-rank trainer, over what ``ranks.trainer`` lets the ranks share.

Two front doors: ``pusher.WeightPusher`` (direct mode) and ``RewardModelHandle.push_weights``
(through the operator).

Nothing is imported here: the modules below import torch, and ``import rewardplane.sdk`` does not.
"""
