"""Where a benchmark's results go: printed, and written as ``$OUT/<name>`` when OUT is set (the
device machine brings back what is under OUT)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def report(doc: Any, name: str) -> None:
    """Print ``doc`` as JSON; where OUT is set, also write it to ``$OUT/name``."""
    print(json.dumps(doc, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(doc, indent=2))
