"""Weight sync on the server: the control plane, pushes from the data plane, the worker extension the engines load, peer restore and persistence."""
