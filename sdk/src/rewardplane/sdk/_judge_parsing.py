"""Reading a score out of a judge's answer (pure): the default parser for the common forms.

Forms, tried in order (the *last* match of a form wins: judges reason first and conclude last):

- ``[[8]]`` (MT-Bench style), also ``[[8.5]]`` and ``[[8/10]]``;
- a keyword and a number: ``Score: 7``, ``Rating = 7/10``, ``score is 4 out of 5``,
  ``Final grade: 9`` (keywords: score, rating, grade, reward, mark);
- the whole answer, or its last non-empty line, is a number or a fraction: ``7``, ``0.75``,
  ``-2``, ``7/10``, ``8.``, ``**8**``.

A fraction gives its numerator (``7/10`` → 7.0): the scale is the prompt's, and the parser does
not change it. Anything else is unparseable (``None``).
"""

from __future__ import annotations

import math
import re

_NUM = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)"
_FRACTION = rf"(?P<num>{_NUM})\s*(?:(?:/|out\s+of)\s*(?P<den>{_NUM}))?"
_BRACKETS = re.compile(rf"\[\[\s*{_FRACTION}\s*\]\]", re.IGNORECASE)
_KEYWORD = re.compile(
    rf"\b(?:score|rating|grade|reward|mark)\b\s*(?:is|of|=|:|-)?\s*[*_`\"']*\s*{_FRACTION}",
    re.IGNORECASE,
)
_BARE = re.compile(rf"^[*_`\"'(\[]*\s*{_FRACTION}\s*[*_`\"')\]]*\s*[.!]?$", re.IGNORECASE)


def _value(match: re.Match[str] | None) -> float | None:
    if match is None:
        return None
    value = float(match.group("num"))
    return value if math.isfinite(value) else None


def parse_score(text: str) -> float | None:
    """The score in a judge's answer, or ``None`` when none of the common forms is there."""
    for pattern in (_BRACKETS, _KEYWORD):
        found = list(pattern.finditer(text))
        if found:
            return _value(found[-1])
    stripped = text.strip()
    lines = [line.strip() for line in stripped.splitlines() if line.strip()]
    for candidate in (stripped, lines[-1] if lines else ""):
        value = _value(_BARE.match(candidate))
        if value is not None:
            return value
    return None
