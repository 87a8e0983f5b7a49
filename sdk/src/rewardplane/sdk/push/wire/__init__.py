"""How a push is started and agreed: announced over HTTP (``http``), from a header in the group's
store (``data_plane``), or through the operator's ``WeightSync`` (``operator``)."""
