"""Docs, result file names and source comments state what is true now; history lives in git.

No page, comment or result name speaks of sessions of work, engineers, "the previous run",
ordinals of runs, "Latest" sections or to-do lists. The checker names every hit as
``path:line: [rule] text``. Technical uses of "session" (a process session, an HTTP or TLS
session, ``requests.Session``, a session-scoped pytest fixture, ``SessionStart``...) are allowed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Markdown that must read as reference.
DOC_FILES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "benchmarks/README.md"]
DOC_DIRS = ["docs"]
# Source trees: their .py files and the pyproject.toml files of the distributions.
SOURCE_DIRS = ["core/src", "sdk/src", "operator/src", "images/reward-server/src", "src/rewardplane"]
PYPROJECTS = [
    "pyproject.toml",
    "core/pyproject.toml",
    "sdk/pyproject.toml",
    "operator/pyproject.toml",
    "images/reward-server/pyproject.toml",
]
RESULTS_DIR = "benchmarks/results"

# Technical meanings of "session", removed from a line before the "session" rule looks at it.
ALLOWED_SESSION = re.compile(
    r"""
      \w+_sessions?\w*                    # start_new_session, end_session, aiohttp_session
    | \bsessions?_\w+                     # session_id
    | \w*[a-z0-9]Session\w*               # ClientSession, AiohttpSession
    | \bSession[A-Z]\w*                   # SessionStart
    | \bSession\b(?=\s*[(:\]`])           # class Session:, Session(), `Session`
    | requests\.Session
    | scope\s*=\s*["']session["']         # @pytest.fixture(scope="session")
    | \bsession[- ]scoped?\b              # a session-scoped fixture
    | \bsessions?\s+of\s+(?:its|their)\s+own\b  # a process session
    | (?<=[=(.,\[])session\b              # code: f(session), x=session
    | \bsession(?=[.=),\]])               # code: session.post, session)
    | \bsession\s*=\s*                    # code: session = ...
    | \bas\s+session\b                    # code: ... as session
    | \bsession\s+fixtures?\b
    | (?:own|new|process|server's|engine's|job's|HTTP|HTTPS|TLS|TCP|NCCL|SSH|aiohttp|httpx|
         client|login|browser|user|pytest|test|kopf's|shell|terminal|tmux)\s+sessions?\b
    """,
    re.IGNORECASE | re.VERBOSE,
)

_ORDINAL_WORDS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)

# (rule, pattern, markdown only). Each pattern is searched in every line of every scanned file
# (the heading rules only in Markdown, where "#" and "**" mean a heading and bold).
RULES: list[tuple[str, re.Pattern[str], bool]] = [
    ("session of work", re.compile(r"\bsessions?\b", re.I), False),
    ("engineers", re.compile(r"\bengineers?\b", re.I), False),
    ("testers", re.compile(r"\btesters?\b", re.I), False),
    ("earlier run", re.compile(r"\b(?:previous|earlier|prior|latest)\s+(?:runs?|rounds?)\b", re.I), False),
    ("round of work", re.compile(r"\b(?:this|that|next)\s+round\b", re.I), False),
    ("ordinal", re.compile(r"\b\d+(?:st|nd|rd|th)\b", re.I), False),
    (
        "ordinal of a run",
        re.compile(rf"\b(?:{_ORDINAL_WORDS})\s+(?:gpu\s+)?(?:session|lease|round)s?\b", re.I),
        False,
    ),
    ("lease of a machine", re.compile(r"\blease\s+\d+\b", re.I), False),
    ("to-do list", re.compile(r"\bto-do\b|\btodo\s+lists?\b|\bwhat is waiting\b", re.I), False),
    # run stories: what became of a run, and what the code does differently since
    (
        "story of a run",
        re.compile(r"\b(?:in|on|of|from|for|by|since|than)\s+that\s+run\b|\b(?-i:That)\s+run\b", re.I),
        False,
    ),
    ("story of a run", re.compile(r"\bnow\s+prints?\b", re.I), False),
    ("story of a run", re.compile(r"\bmoved\s+from\b", re.I), False),
    # in prose only: code says a bounded wait "ran out" and a place was "taken back"
    ("story of a run", re.compile(r"\bran\s+out\b", re.I), True),
    ("story of a run", re.compile(r"\btaken\s+back\b", re.I), True),
    ("history heading", re.compile(r"^\s{0,3}#{1,6}\s.*\b(?:latest|earlier|previous|history)\b", re.I), True),
    ("history heading", re.compile(r"\*\*(?:latest|earlier|previous)\b", re.I), True),
]

# Result files: <benchmark>-<what>-<YYYY-MM-DD>-<commit>.json, nothing that orders runs.
RESULT_NAME = re.compile(
    r"^(?P<bench>[a-z][a-z0-9_]*)-(?P<what>[A-Za-z0-9._-]+)-\d{4}-\d{2}-\d{2}-[0-9a-f]{7,40}\.json$"
)
RESULT_NAME_FORBIDDEN = re.compile(
    rf"(?:^|[-_.])(?:run\d+|\d+(?:st|nd|rd|th)|{_ORDINAL_WORDS}|session\w*|latest|final|previous|earlier|"
    r"before|after|old|new|ab|v\d+)(?=$|[-_.])",
    re.IGNORECASE,
)


def check_text(text: str, where: str = "<text>.md") -> list[str]:
    """Every line of ``text`` that breaks a rule, as ``where:line: [rule] text``."""
    markdown = where.endswith(".md")
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for rule, pattern, markdown_only in RULES:
            if markdown_only and not markdown:
                continue
            probe = ALLOWED_SESSION.sub("", line) if rule == "session of work" else line
            if pattern.search(probe):
                hits.append(f"{where}:{number}: [{rule}] {line.strip()[:160]}")
    return hits


def check_result_name(name: str, benchmarks: set[str] | None = None) -> list[str]:
    """What is wrong with a result file's name (empty when nothing is)."""
    match = RESULT_NAME.match(name)
    if match is None:
        return [f"{name}: [result name] not <benchmark>-<what>-<YYYY-MM-DD>-<commit>.json"]
    problems = []
    if benchmarks is not None and match["bench"] not in benchmarks:
        problems.append(f"{name}: [result name] no benchmarks/{match['bench']}.py")
    if RESULT_NAME_FORBIDDEN.search(match["what"]):
        problems.append(f"{name}: [result name] orders runs instead of naming what was measured")
    return problems


def scanned_files() -> list[Path]:
    files = [ROOT / f for f in DOC_FILES + PYPROJECTS if (ROOT / f).is_file()]
    for d in DOC_DIRS:
        files += sorted((ROOT / d).rglob("*.md"))
    for d in SOURCE_DIRS:
        files += sorted(p for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def test_docs_and_sources_state_what_is_true_now() -> None:
    files = scanned_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files)
    hits = []
    for path in files:
        hits += check_text(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not hits, "history wording (history lives in git; CONTRIBUTING.md):\n" + "\n".join(hits)


def test_result_files_are_named_by_benchmark_date_and_commit() -> None:
    benchmarks = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    names = sorted(p.name for p in (ROOT / RESULTS_DIR).iterdir() if p.is_file())
    assert names
    problems = [problem for name in names for problem in check_result_name(name, benchmarks)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("The tenth GPU session measured 38.5 ms.", "session of work"),
        ("0.2 ms until the tenth GPU session; 2 ms since", "ordinal of a run"),
        ("## Next GPU session: what is waiting", "to-do list"),
        ("2-core VM, other engineers' suites running", "engineers"),
        ("Slower than the previous run.", "earlier run"),
        ("What this round changed", "round of work"),
        ("as in the 9th run", "ordinal"),
        ("**Latest: 4× H100, 2026-11-26**", "history heading"),
        ("## Earlier GPU figures", "history heading"),
        ("| 2 | the defaults | lease 2 |", "lease of a machine"),
        ("The to-do list below.", "to-do list"),
        ("measured by the testers", "testers"),
        ("That run stored only the largest gap.", "story of a run"),
        ("the gap to raw in that run", "story of a run"),
        ("the benchmark now prints each gap", "story of a run"),
        ("vllm serve moved from 0.992 to 0.938", "story of a run"),
        ("the device time ran out before it", "story of a run"),
        ("the machine was taken back during its 6.6B phase", "story of a run"),
    ],
)
def test_the_checker_flags_history_wording(text: str, rule: str) -> None:
    hits = check_text(text, "sample.md")
    assert any(f"[{rule}]" in hit and hit.startswith("sample.md:1: ") for hit in hits), hits


@pytest.mark.parametrize(
    "text",
    [
        "proc = subprocess.Popen(cmd, start_new_session=True)",
        "Children run in their own session (``start_new_session=True``).",
        "vLLM's engine core runs in the server's session and can outlive it.",
        "async with aiohttp.ClientSession() as session:",
        "async def login() -> kopf.AiohttpSession: ...  # aiohttp_session=session",
        '@pytest.fixture(scope="session")',
        "a session-scoped fixture builds the model once",
        "requests.Session() keeps the TLS session",
        "the SessionStart hook",
        "at most an eighth of the others' bytes",
        "every replica of the second model",
        "the latest value per name; generate_latest(registry)",
        "restore_plan returns what to do: todo.from_disk",
        "a baseline measured in the same run",
        "tests that run against a real API server",
        "the engines that run the model",
    ],
)
def test_the_checker_leaves_technical_wording_alone(text: str) -> None:
    assert check_text(text, "sample.md") == []
    assert check_text(text, "sample.py") == []


def test_headings_are_checked_in_markdown_only() -> None:
    assert check_text("merged = {**previous, **patch}  # latest", "sample.py") == []
    assert check_text("# Latest figures", "sample.md") != []


def _cited_results() -> set[str]:
    """Result files the docs name (``results/<file>.json``; ``{a,b}`` spells several)."""
    cited: set[str] = set()
    for path in [ROOT / "README.md", ROOT / "benchmarks/README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in re.finditer(r"results/([A-Za-z0-9._{},-]+\.json)", path.read_text(encoding="utf-8")):
            name = match[1]
            brace = re.search(r"\{([^}]*)\}", name)
            options = brace[1].split(",") if brace else [""]
            cited |= {name.replace(brace[0], o) if brace else name for o in options}
    return cited


def test_every_result_file_is_cited_and_every_cited_file_exists() -> None:
    """CONTRIBUTING: a result file no current table cites is deleted; a table cites no file that
    is not there."""
    files = {p.name for p in (ROOT / RESULTS_DIR).iterdir() if p.is_file()}
    cited = _cited_results()
    assert not files - cited, f"result files no doc cites (delete them): {sorted(files - cited)}"
    assert not cited - files, f"result files cited but not in {RESULTS_DIR}: {sorted(cited - files)}"


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("weight_sync-vllm-7b-4xH100-2026-11-27-99761cf.json", True),
        ("copy_plan-vllm0.24-qwen2-cpu-2core-2026-11-26-75de42e.json", True),
        ("weight_sync-vllm-7b-4xH100-10th-final.json", False),
        ("weight_sync-vllm-7b-4xH100-10th-2026-11-27-99761cf.json", False),
        ("operator-scale1000-run3-2core-2026-11-26-3240cba.json", False),
        ("weight_sync-vllm-7b-4xH100-session-start-2026-11-26-7669c32.json", False),
        ("weight_sync-vllm-7b-4xH100.json", False),
    ],
)
def test_result_names(name: str, ok: bool) -> None:
    assert (check_result_name(name, {"weight_sync", "copy_plan", "operator"}) == []) is ok
