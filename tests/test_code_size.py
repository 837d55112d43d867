"""No class over 300 lines, no function over 80 and no file over 600 in weft-core, except where :data:`EXCEPTIONS`
says why. Read with ast: nothing is imported.

A definition's lines run from its ``def`` or ``class`` line to its last line (its docstring and comments included,
its decorators not); methods and nested functions count as functions, nested classes as classes. A file's lines are
all of its lines. The limits are where a newcomer stops reading a piece whole: past them, split along the concepts
the piece holds (``weft.runner.model_runner`` and ``weft.runner.graphs``), or name it here with why it is clearer
whole.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "core" / "src"

LIMITS = {"file": 600, "class": 300, "function": 80}
"""Kind -> the most lines one may have."""


EXCEPTIONS: dict[str, str] = {}
"""``"<kind> <file>[::<qualified name>]"`` -> why it is clearer whole (or where it is being split)."""


class Size(NamedTuple):
    kind: str
    """``file``, ``class`` or ``function``."""
    name: str
    """``<file>`` or ``<file>::<qualified name>``, the file relative to the sources."""
    lines: int

    @property
    def key(self) -> str:
        return f"{self.kind} {self.name}"

    def __str__(self) -> str:
        return f"  {self.key}: {self.lines} lines (limit {LIMITS[self.kind]})"


def sizes(sources: Path) -> list[Size]:
    """The size of every file, class and function under ``sources/weft``."""
    found = []
    for path in sorted((sources / "weft").rglob("*.py")):
        text = path.read_text()
        shown = path.relative_to(sources).as_posix()
        found.append(Size("file", shown, len(text.splitlines())))

        def visit(node: ast.AST, prefix: str, shown: str = shown) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    assert child.end_lineno is not None
                    found.append(Size(kind, f"{shown}::{prefix}{child.name}", child.end_lineno - child.lineno + 1))
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(ast.parse(text, str(path)), "")
    return found


def oversized(found: list[Size]) -> list[Size]:
    return [size for size in found if size.lines > LIMITS[size.kind]]


def test_no_file_class_or_function_is_over_its_limit():
    found = [size for size in oversized(sizes(SOURCES)) if size.key not in EXCEPTIONS]
    assert not found, (
        "over the size limits (split along the concepts it holds, or add it to EXCEPTIONS with why "
        "it is clearer whole):\n" + "\n".join(map(str, found))
    )


def test_every_exception_is_still_over_its_limit():
    over = {size.key for size in oversized(sizes(SOURCES))}
    stale = [key for key in EXCEPTIONS if key not in over]
    assert not stale, f"EXCEPTIONS names pieces that are within the limits now (or gone); remove them: {stale}"


def test_the_size_check_finds_what_it_looks_for(tmp_path):
    """A made-up tree with one piece just over each limit and one at it."""
    body = "    x = 1\n"
    files = {
        "weft/__init__.py": "",
        # def line + 79 body lines: 80, at the limit; the method: 81 lines, one over.
        "weft/fits.py": "def at_limit():\n" + body * 79,
        "weft/long.py": "class Holder:\n    def method(self):\n" + "        x = 1\n" * 80,
        # A class of 301 lines (its methods 4 lines each, none over).
        "weft/wide.py": "class Wide:\n" + "    def f(self):\n        x = 1\n        y = 2\n        return x + y\n" * 75,
        "weft/big.py": "x = 1\n" * 601,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    found = oversized(sizes(tmp_path))
    assert [str(size) for size in found] == [
        "  file weft/big.py: 601 lines (limit 600)",
        "  function weft/long.py::Holder.method: 81 lines (limit 80)",
        "  class weft/wide.py::Wide: 301 lines (limit 300)",
    ]
    assert Size("function", "weft/fits.py::at_limit", 80) in sizes(tmp_path)
