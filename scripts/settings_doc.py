"""Write docs/settings.md from the settings registry (``rewardplane.protocol.settings``).

``python scripts/settings_doc.py`` writes the page; ``--check`` only says whether it is current
(exit 1 if not). ``tests/unit/test_settings_registry.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rewardplane.protocol.settings import markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md is not current")
    args = p.parse_args(argv)
    text = markdown()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python scripts/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
