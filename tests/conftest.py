import importlib.util

pytest_plugins = ["tests.fixtures.models", "tests.fixtures.servers"]
# The cluster fixtures need the kubernetes client (extra `operator`); the GPU machine runs without it.
if importlib.util.find_spec("kubernetes") is not None:
    pytest_plugins += ["tests.fixtures.cluster", "tests.fixtures.operator"]
