from .cli import main

# Guarded: vLLM workers started with "spawn" re-import the main module and must not start a server.
if __name__ == "__main__":
    raise SystemExit(main())
