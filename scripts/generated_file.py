"""The command line of a script that generates a checked-in file: write it, or with ``--check``
only say whether it is current (exit 1 if not). ``scripts/settings_doc.py`` and
``scripts/dashboard.py`` use it; CI runs their ``--check``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_or_check(
    path: Path, text: str, script: str, description: str | None, argv: list[str] | None
) -> int:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--check", action="store_true", help=f"exit 1 if {path.name} is not current")
    args = p.parse_args(argv)
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run python {script}", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
