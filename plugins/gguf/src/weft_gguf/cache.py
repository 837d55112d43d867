"""``weft cache list | clear``: what weft-gguf has cached from GGUF files, and freeing it.

Contributed to the ``weft`` command through the ``weft_cli_commands`` hook; importing this module
imports neither torch nor gguf. The cache folder is :func:`weft_gguf.files.cache_dir`'s ``gguf``
folder; its entries are named by :func:`weft_gguf.files.file_key` (``<content hash>-<what>-v<format>``
and an extension), and the source file of each is found in the index of hashed files
(:func:`weft_gguf.files.read_sources_index`). Whatever is cached is rebuilt on the next start that
needs it, so ``clear`` asks no question.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from weft.api import human_bytes
from weft.contracts.hooks import CliCommand, hookimpl
from weft_gguf import checksum
from weft_gguf.files import CACHE_FORMAT, KEY_HASH_CHARS, SOURCES_INDEX, cache_dir, read_sources_index

_ENTRY = re.compile(rf"^(?P<hash>[0-9a-f]{{{KEY_HASH_CHARS}}})-(?P<what>.+)-v(?P<format>\d+)(?P<suffix>\.\w+)$")
_KINDS = {".safetensors": "weights", ".tokenizer": "tokenizer", ".json": "metadata"}


@hookimpl
def weft_cli_commands() -> list[CliCommand]:
    return [
        CliCommand(
            name="cache",
            help="list or clear the converted-weights cache (dequantized GGUF weights, tokenizers)",
            add_arguments=add_arguments,
            run=run,
        )
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(title="cache commands", metavar="COMMAND")
    commands.add_parser("list", help="each cached entry: its source file, what it holds and its size").set_defaults(
        cache_command=run_list
    )
    commands.add_parser(
        "clear", help="delete the whole cache (it is rebuilt on the next start that needs it)"
    ).set_defaults(cache_command=run_clear)


def run(args: argparse.Namespace) -> int:
    command = getattr(args, "cache_command", None)
    if command is None:
        print("usage: weft cache list | clear", file=sys.stderr)
        return 2
    return command(args)


def cache_folder() -> Path:
    return cache_dir() / "gguf"


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
    return path.stat().st_size


def entries() -> list[tuple[str, str, int]]:
    """``(source, what, bytes)`` of every entry of the cache folder, a checksum file counted with its entry;
    the entries whose names this version does not write are one row, an earlier version's."""
    folder = cache_folder()
    if not folder.is_dir():
        return []
    names: dict[str, set[str]] = {}
    for path, recorded in read_sources_index().items():
        if isinstance(recorded, dict) and "sha256" in recorded:
            names.setdefault(str(recorded["sha256"])[:KEY_HASH_CHARS], set()).add(Path(path).name)
    rows, earlier = [], []
    for path in sorted(folder.iterdir()):
        if path.name.endswith(".sha256") and path.with_name(path.name.removesuffix(".sha256")).exists():
            continue
        size = size_of(path) + (checksum.sidecar(path).stat().st_size if checksum.sidecar(path).is_file() else 0)
        match = _ENTRY.match(path.name)
        if path.name == SOURCES_INDEX:
            continue
        if match is None or match["format"] != CACHE_FORMAT:
            earlier.append(size)
        else:
            source = ", ".join(sorted(names.get(match["hash"], {"(not in the index)"})))
            kind = _KINDS.get(match["suffix"], match["suffix"])
            rows.append((source, f"{kind} {match['what']}" if kind == "weights" else match["what"], size))
    rows.sort()
    if earlier:
        rows.append(("?", f"{len(earlier)} entries an earlier weft-gguf wrote (unused)", sum(earlier)))
    return rows


def run_list(args: argparse.Namespace) -> int:
    rows = entries()
    if not rows:
        print(f"the cache is empty ({cache_folder()})")
        return 0
    print(f"{cache_folder()}: {human_bytes(sum(size for _, _, size in rows))}")
    widths = [max(len(header), *(len(row[column]) for row in rows)) for column, header in enumerate(("SOURCE", "WHAT"))]
    print(f"{'SOURCE':<{widths[0]}}  {'WHAT':<{widths[1]}}  SIZE")
    for source, what, size in rows:
        print(f"{source:<{widths[0]}}  {what:<{widths[1]}}  {human_bytes(size)}")
    print("weft cache clear frees it all.")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    folder = cache_folder()
    if not folder.is_dir():
        print(f"the cache is empty ({folder})")
        return 0
    freed = size_of(folder)
    shutil.rmtree(folder)
    print(f"freed {human_bytes(freed)} ({folder})")
    return 0
