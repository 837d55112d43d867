"""The "safetensors" loader: a Hugging Face folder (config.json, *.safetensors, tokenizer files,
an optional generation_config.json).

Sources it accepts: a local folder, or a Hugging Face repo id whose snapshot is
in the local cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``), optionally pinned as ``repo@revision`` where the
revision is a ref name or a 40-hex commit. It never downloads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch

from weft.contracts.loader import ModelSource, WeightLoader, WeightSlice
from weft.generation_config import read_generation_config

_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of ``repo_id`` (``org/name`` or ``org/name@revision``), or None."""
    repo, _, revision = repo_id.partition("@")
    root = hub_cache() / f"models--{repo.replace('/', '--')}"
    revision = revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        commit = revision
    else:
        ref = root / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = root / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


class SafetensorsLoader(WeightLoader):
    """Hugging Face folders of *.safetensors weights, local or in the HF cache."""

    priority: ClassVar[int] = 0

    def _folder(self, source: str) -> Path | None:
        path = Path(source).expanduser()
        if path.is_dir():
            return path
        if _REPO_ID.match(source) and not source.startswith((".", "/")):
            return cached_snapshot(source)
        return None

    def accepts(self, source: str) -> bool:
        try:
            folder = self._folder(source)
        except OSError:
            return False
        return folder is not None and (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))

    def resolve(self, source: str) -> ModelSource:
        folder = self._folder(source)
        if folder is None:
            raise ValueError(
                f"model {source!r}: not a folder, and not a Hugging Face repo id in the local cache ({hub_cache()}); "
                f"download it first (huggingface-cli download {source.split('@')[0]}) or give a folder"
            )
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model {source!r}: {config_file} is missing")
        if not any(folder.glob("*.safetensors")):
            raise ValueError(f"model {source!r}: no *.safetensors files in {folder}")
        name = source if not Path(source).expanduser().is_dir() else folder.resolve().name
        return ModelSource(
            path=str(folder.resolve()), format="safetensors", hf_config=json.loads(config_file.read_text()),
            tokenizer="hf", name=name, generation_config=read_generation_config(folder),
        )

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, part in self.iter_weight_slices(source, dtype):
            yield name, part.load()

    def iter_weight_slices(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, WeightSlice]]:
        from safetensors import safe_open

        target = getattr(torch, dtype)
        for file in sorted(Path(source.path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, SafetensorsSlice(handle.get_slice(name), target)


class SafetensorsSlice(WeightSlice):
    """One tensor of an open safetensors file; ``narrow`` reads only the asked range from disk."""

    def __init__(self, stored: object, dtype: torch.dtype) -> None:
        self.stored = stored
        self.dtype = dtype
        self.shape = tuple(stored.get_shape())

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        # Integer tensors (DeepSeek V4's token -> expert table) are indices, not weights.
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return self._cast(self.stored[index])

    def load(self) -> torch.Tensor:
        return self._cast(self.stored[:] if self.shape else self.stored[()])
