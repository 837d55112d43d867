"""The "safetensors" loader: a Hugging Face folder (config.json, *.safetensors, tokenizer files,
an optional generation_config.json).

Sources it accepts: a local folder, or a Hugging Face repo id (``org/name``, ``org/name@revision``;
``engine.revision`` likewise), found in the local cache or downloaded by :mod:`weft.hub`. The
shards read are those ``model.safetensors.index.json`` names, else every ``*.safetensors``.

torch is imported where tensors are made, not at the top: ``weft serve``'s API process loads every loader
to resolve the model (:func:`weft.resolve.resolve_source`) and imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from weft.contracts.loader import ModelSource, WeightLoader, WeightSlice
from weft.generation_config import read_generation_config
from weft.hub import hub_cache, is_repo_id, snapshot, weight_files

if TYPE_CHECKING:
    import torch


def cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """A checkpoint tensor in the asked dtype; integer tensors (DeepSeek V4's token -> expert table) are
    indices, not weights, and stay as stored."""
    import torch

    return tensor.to(getattr(torch, dtype)) if tensor.is_floating_point() else tensor


class SafetensorsLoader(WeightLoader):
    """Hugging Face folders of *.safetensors weights, local or in the HF cache."""

    priority: ClassVar[int] = 0

    def accepts(self, source: str) -> bool:
        """A folder with a config and safetensors weights, or a repo id (resolving it may download)."""
        try:
            folder = Path(source).expanduser()
            if folder.is_dir():
                return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
        except OSError:
            return False
        return is_repo_id(source)

    def folder(self, source: str) -> Path:
        """The local folder of ``source``: the folder itself, or a repo id's snapshot (downloaded if missing)."""
        path = Path(source).expanduser()
        if path.is_dir():
            return path
        if is_repo_id(source):
            return snapshot(source, self.load_config.revision, self.load_config.download_dir)
        raise ValueError(
            f"model {source!r}: not a folder, and not a Hugging Face repo id (org/name); give a folder with "
            f"config.json and *.safetensors, or a repo id (cache: {hub_cache(self.load_config.download_dir)})"
        )

    def resolve(self, source: str) -> ModelSource:
        folder = self.folder(source)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model {source!r}: {config_file} is missing")
        if not weight_files(folder):
            raise ValueError(f"model {source!r}: no *.safetensors files in {folder}")
        name = source if not Path(source).expanduser().is_dir() else folder.resolve().name
        return ModelSource(
            path=str(folder.resolve()),
            format="safetensors",
            hf_config=json.loads(config_file.read_text()),
            tokenizer="hf",
            name=name,
            generation_config=read_generation_config(folder),
        )

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, part in self.iter_weight_slices(source, dtype):
            yield name, part.load()

    def iter_weight_slices(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, WeightSlice]]:
        if type(self).iter_weights is not SafetensorsLoader.iter_weights:
            # A subclass that reads its own way (fastsafetensors, the weight-cache daemon): its tensors,
            # whole, never this class's partial reads of the files behind its back.
            yield from super().iter_weight_slices(source, dtype)
            return
        from safetensors import safe_open

        for file in weight_files(Path(source.path)):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    yield name, SafetensorsSlice(handle.get_slice(name), dtype)


class SafetensorsSlice(WeightSlice):
    """One tensor of an open safetensors file; ``narrow`` reads only the asked range from disk."""

    def __init__(self, stored: object, dtype: str) -> None:
        self.stored = stored
        self.dtype = dtype
        self.shape = tuple(stored.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return cast(self.stored[index], self.dtype)

    def load(self) -> torch.Tensor:
        return cast(self.stored[:] if self.shape else self.stored[()], self.dtype)
