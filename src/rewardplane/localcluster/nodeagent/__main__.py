"""``python -m rewardplane.localcluster.nodeagent``: the same as ``rewardplane node``."""

import sys

from rewardplane.localcluster.nodeagent.cli import main

sys.exit(main())
