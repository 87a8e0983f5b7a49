import os

# Before torch loads: c10d logs a C++ warning with its whole stack trace each time a trainer closes
# the rendezvous store under a wait of ours (every push ends so); the wait's failure is handled, so
# only errors are logged. TORCH_CPP_LOG_LEVEL=WARNING (or INFO) brings the warnings back.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from rewardplane.server.cli import main  # noqa: E402

# Guarded: vLLM workers started with "spawn" re-import the main module and must not start a server.
if __name__ == "__main__":
    raise SystemExit(main())
