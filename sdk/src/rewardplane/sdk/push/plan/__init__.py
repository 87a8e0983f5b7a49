"""What a push sends: names checked for the mode (``checks``), each rank's parts (``layout``), the
tensors that changed (``delta``) and what tensor-parallel replicas keep (``slices``)."""
