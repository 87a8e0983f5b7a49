"""The parts of the weight-sync worker extension, one concern each, over the engine's
``WorkerHost`` (``state.py``); ``parts.py`` builds them and ``worker_extension`` owns them."""
