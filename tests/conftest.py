pytest_plugins = ["tests.fixtures.models", "tests.fixtures.servers"]
