"""Who sends a push: every rank of a multi-rank trainer, direct (``sharded``) or through the
operator (``operator``), over what the ranks share (``trainer``)."""
