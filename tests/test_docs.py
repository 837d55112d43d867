"""The docs quote the repository's files as they are, and point at nothing outside it (a clone has only this)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] + sorted(ROOT.glob("plugins*/**/README.md"))
QUOTED = re.compile(r"<!-- file: (?P<path>\S+) -->\n```\w*\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])(?P<path>(?:\.\./)+[\w./-]+|[\w-]+(?:/[\w.-]+)+\.\w+)")


def test_quoted_files_are_the_files():
    quoted = {}
    for doc in DOCS:
        for match in QUOTED.finditer(doc.read_text()):
            path = match["path"]
            assert (ROOT / path).is_file(), f"{doc.name} quotes {path}, which is not in the repository"
            assert match["code"] == (ROOT / path).read_text(), (
                f"{doc.name}'s copy of {path} differs from the file; paste the file into the docs again"
            )
            quoted[path] = doc.name
    assert {
        "tests/disk_connector/pyproject.toml",
        "tests/disk_connector/src/weft_example_disk/connector.py",
        "tests/disk_connector/demo.py",
    } <= set(quoted), quoted


def test_links_and_paths_stay_inside_the_repository():
    top_level = {entry.name for entry in ROOT.iterdir()}
    problems = []
    for doc in DOCS:
        text = doc.read_text()
        for match in LINK.finditer(text):
            target = match["target"].split("#")[0]
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a web page (or any other scheme): not in a clone
                problems.append(
                    f"{doc.relative_to(ROOT)}: link {match['target']!r} leaves the repository; name it in text"
                )
                continue
            if not target:
                continue
            resolved = (doc.parent / target).resolve()
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                problems.append(f"{doc.relative_to(ROOT)}: link {match['target']!r}")
        for match in PATH.finditer(text):
            path = match["path"]
            if path.startswith("../"):
                problems.append(f"{doc.name}: {path!r} is outside the repository")
            elif path.split("/")[0] in top_level and not (ROOT / path).exists():
                problems.append(f"{doc.name}: {path!r} does not exist")
    assert not problems, "docs point outside the repository or at missing files:\n" + "\n".join(problems)
