"""How long the project's units are, read from the source with ``ast``: no class is over
``CLASS_LIMIT`` lines, counting the lines of the project's own classes it inherits from (a class
spread over a chain of bases in other files is read as one), and no function or method over
``FUNCTION_LIMIT`` lines. ``benchmarks/`` is left out.

The source is indexed once (``project_index``); a check of another kind of unit adds its own
walk over ``index.modules`` and its own limit."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ["core/src", "sdk/src", "operator/src", "images/reward-server/src", "src"]
CLASS_LIMIT = 350
FUNCTION_LIMIT = 100
# Over the limit today, each split by other work: its size here, so that a class that grows fails
# and one that shrinks under the limit is taken off this list.
CLASSES_BEING_SPLIT: dict[str, int] = {}


@dataclass
class ClassUnit:
    qualname: str  # module.Class
    lines: int  # its own lines, decorators included
    bases: list[str]  # the qualnames of the project's classes it names as bases


@dataclass
class Index:
    modules: dict[str, ast.Module] = field(default_factory=dict)  # module name -> its tree
    classes: dict[str, ClassUnit] = field(default_factory=dict)

    def inherited_lines(self, qualname: str) -> int:
        """The class's lines plus those of every project class above it (each counted once)."""
        seen: set[str] = set()
        todo = [qualname]
        while todo:
            name = todo.pop()
            if name in seen or name not in self.classes:
                continue
            seen.add(name)
            todo.extend(self.classes[name].bases)
        return sum(self.classes[n].lines for n in seen)


def index_sources(sources: dict[str, str]) -> Index:
    """Index module name -> source text: every top-level class, its bases resolved through the
    module's own definitions and its ``from ... import`` names."""
    index = Index()
    for module, text in sources.items():
        index.modules[module] = ast.parse(text)
    for module, tree in index.modules.items():
        names: dict[str, str] = {}  # a name bound in the module -> the qualname it stands for
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.ClassDef):
                names[node.name] = f"{module}.{node.name}"
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            bases = [names[b.id] for b in node.bases if isinstance(b, ast.Name) and b.id in names]
            end = node.end_lineno or node.lineno
            index.classes[f"{module}.{node.name}"] = ClassUnit(
                f"{module}.{node.name}", end - start + 1, bases
            )
    return index


@cache
def project_index() -> Index:
    sources: dict[str, str] = {}
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            sources[module] = path.read_text()
    return index_sources(sources)


def classes_over(index: Index, limit: int) -> dict[str, int]:
    sizes = {q: index.inherited_lines(q) for q in index.classes}
    return {q: n for q, n in sizes.items() if n > limit}


def functions_over(index: Index, limit: int) -> dict[str, int]:
    """Every function and method (nested ones too, each measured alone, decorators included) over
    ``limit`` lines: module.name, or module.Class.name for a method."""
    over: dict[str, int] = {}
    for module, tree in index.modules.items():
        todo: list[tuple[str, ast.AST]] = [(module, tree)]
        while todo:
            prefix, node = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    name = f"{prefix}.{child.name}"
                    todo.append((name, child))
                    if isinstance(child, ast.ClassDef):
                        continue
                    start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    lines = (child.end_lineno or child.lineno) - start + 1
                    if lines > limit:
                        over[name] = lines
                else:
                    todo.append((prefix, child))
    return over


def test_no_function_is_over_the_limit() -> None:
    over = functions_over(project_index(), FUNCTION_LIMIT)
    assert not over, f"functions over {FUNCTION_LIMIT} lines: split them by step: {over}"


def test_a_long_function_or_method_is_caught_wherever_it_stands() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(100))
    method = "\n".join(f"        x{i} = {i}" for i in range(99))
    index = index_sources(
        {
            "pkg.long": f"def long():\n{body}\n\n\ndef short():\n    pass\n",
            "pkg.cls": f"class C:\n    @property\n    def m(self):\n{method}\n\n    def n(self):\n        pass\n",
            "pkg.nested": f"def outer():\n    def inner():\n{method}\n\n    return inner\n",
        }
    )
    long = {"pkg.long.long": 101, "pkg.cls.C.m": 101, "pkg.nested.outer": 103}
    assert functions_over(index, FUNCTION_LIMIT) == long
    # a nested function is measured alone too (it counts in the one around it as well)
    assert functions_over(index, FUNCTION_LIMIT - 1) == {**long, "pkg.nested.outer.inner": 100}


def test_no_class_is_over_the_limit_counting_what_it_inherits() -> None:
    over = classes_over(project_index(), CLASS_LIMIT)
    new = {q: n for q, n in over.items() if q not in CLASSES_BEING_SPLIT}
    assert not new, (
        f"classes over {CLASS_LIMIT} lines (with their project bases): split them by concern: {new}"
    )
    grown = {q: n for q, n in over.items() if n > CLASSES_BEING_SPLIT.get(q, n)}
    assert not grown, f"classes being split grew: {grown}"
    done = sorted(set(CLASSES_BEING_SPLIT) - set(over))
    assert not done, f"no longer over {CLASS_LIMIT} lines: take them off CLASSES_BEING_SPLIT: {done}"


def test_a_class_is_measured_with_the_bases_it_inherits_from_other_modules() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(199))
    index = index_sources(
        {
            "pkg.base": f"class Base:\n{body}\n",
            "pkg.mid": f"from pkg.base import Base\n\n\nclass Mid(Base):\n{body}\n",
            "pkg.leaf": "from pkg.mid import Mid\nfrom other import External\n\n\nclass Leaf(Mid, External):\n    pass\n",
        }
    )
    assert index.inherited_lines("pkg.base.Base") == 200
    assert index.inherited_lines("pkg.leaf.Leaf") == 402  # External is not the project's: not counted
    assert classes_over(index, CLASS_LIMIT) == {"pkg.mid.Mid": 400, "pkg.leaf.Leaf": 402}
