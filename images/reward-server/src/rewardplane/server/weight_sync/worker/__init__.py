"""The parts of the weight-sync worker extension, one concern each; ``worker_extension``
composes them into the class vLLM loads."""
