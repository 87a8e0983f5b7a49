"""Write docs/settings.md from the settings registry (``rewardplane.protocol.settings``).

``python scripts/settings_doc.py`` writes the page; ``--check`` only says whether it is current
(exit 1 if not). ``tests/unit/test_settings_registry.py`` runs the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

from generated_file import write_or_check

from rewardplane.protocol.settings import markdown

PAGE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(PAGE, markdown(), "scripts/settings_doc.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
