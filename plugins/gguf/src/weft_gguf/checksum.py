"""Checksums of the caches (dequantized weights, tokenizer folders): what was written is what is read, or it is rebuilt.

Beside each cache file lies ``<file>.sha256``: its size and the SHA-256 of each
64 MiB chunk; a cached folder has one beside each of its files. Verifying hashes the chunks on a thread pool (hashlib
releases the GIL), so a large cache costs a fraction of a second per gigabyte on a many-core host.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from weft.api import usable_cpus

CHUNK_BYTES = 64 << 20
FORMAT = 1


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _chunk_digest(path: Path, index: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(index * CHUNK_BYTES)
        return hashlib.sha256(handle.read(CHUNK_BYTES)).hexdigest()


def digests(path: Path) -> list[str]:
    chunks = max(1, -(-path.stat().st_size // CHUNK_BYTES))
    with ThreadPoolExecutor(max_workers=min(chunks, usable_cpus())) as pool:
        return list(pool.map(lambda index: _chunk_digest(path, index), range(chunks)))


def record(path: Path, destination: Path) -> Path:
    """Write the checksum file of ``path`` (to be renamed beside ``destination``); returns it."""
    written = sidecar(path)
    written.write_text(
        json.dumps({"format": FORMAT, "size": path.stat().st_size, "chunk_bytes": CHUNK_BYTES, "sha256": digests(path)})
    )
    return written


def problem(path: Path) -> str | None:
    """Why the cache file at ``path`` cannot be trusted (truncated, changed, no checksum), or None."""
    try:
        recorded = json.loads(sidecar(path).read_text())
    except (OSError, ValueError):
        return "missing its checksum file"
    if not isinstance(recorded, dict) or recorded.get("format") != FORMAT or recorded.get("chunk_bytes") != CHUNK_BYTES:
        return "recorded in an unknown checksum format"
    size = path.stat().st_size
    if size != recorded.get("size"):
        return f"{size} bytes long where {recorded.get('size')} were written (truncated or overwritten)"
    if digests(path) != recorded.get("sha256"):
        return "changed since it was written (its checksum does not match)"
    return None


def remove(path: Path) -> None:
    for file in (path, sidecar(path)):
        try:
            file.unlink()
        except FileNotFoundError:
            pass


def record_folder(folder: Path) -> None:
    """Write the checksum file of each file in ``folder`` (a cache folder about to be renamed into place)."""
    for file in [file for file in folder.iterdir() if file.is_file()]:
        record(file, file)


def folder_problem(folder: Path) -> str | None:
    """Why the cache folder cannot be trusted (empty, or a file truncated, changed or without its checksum), or None."""
    files = sorted(file for file in folder.iterdir() if file.is_file() and not file.name.endswith(".sha256"))
    if not files:
        return "empty"
    for file in files:
        wrong = problem(file)
        if wrong is not None:
            return f"{file.name}: {wrong}"
    return None
