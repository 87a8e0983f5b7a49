"""Build the tiny random-weight reward model the examples use (no downloads).

python examples/make_tiny_model.py [--out /tmp/rewardplane-tiny-rm] [--num-labels 1]
"""

from rewardplane.tinymodel import main

if __name__ == "__main__":
    raise SystemExit(main())
