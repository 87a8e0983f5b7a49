"""The model fetcher: ``python -m rewardplane.modelfetch``, the ``fetch-model`` init container of a
reward-server Pod whose ``spec.model.source`` is downloaded (s3://, https://, hf://). It fills the
node cache (``cache.py``) and prints progress lines the operator reads into the status;
``rewardplane.protocol.model_sources`` is the contract with the operator. It imports neither torch
nor the server: an init container starts in a second."""
