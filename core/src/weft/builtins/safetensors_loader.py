"""The "safetensors" loader: a Hugging Face folder (config.json, *.safetensors, tokenizer files,
an optional generation_config.json).

Sources it accepts: a local folder, or a Hugging Face repo id (``org/name``, ``org/name@revision``;
``engine.revision`` likewise), found in the local cache or downloaded by :mod:`weft.hub`. The
shards read are those ``model.safetensors.index.json`` names, else every ``*.safetensors``.

fp8 checkpoints (``quantization_config`` of ``quant_method`` ``"compressed-tensors"`` with 8-bit float
weights, as llm-compressor writes them, or ``"fbgemm_fp8"``) store each quantized linear weight as
float8_e4m3fn codes ``X.weight`` and a float32 ``X.weight_scale`` (one per output channel ``[out, 1]``,
or one for the tensor); the loader yields each such pair as one :class:`Fp8Weight` (codes and scales
for a quantization method, dequantized floats for everything else) and drops the activation scales
(``X.input_scale``, ``X.input_scale_ub``): activations get dynamic scales.

torch is imported where tensors are made, not at the top: ``weft serve``'s API process loads every loader
to resolve the model (:func:`weft.resolve.resolve_source`) and imports no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from weft.contracts.loader import ModelSource, WeightLoader, WeightSlice
from weft.contracts.quantization import GroupAffine, QuantizedWeight
from weft.generation_config import read_generation_config
from weft.hub import hub_cache, is_repo_id, snapshot, weight_files

if TYPE_CHECKING:
    import torch


def cast(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    """A checkpoint tensor in the asked dtype; integer tensors (DeepSeek V4's token -> expert table) are
    indices, not weights, and stay as stored."""
    import torch

    return tensor.to(getattr(torch, dtype)) if tensor.is_floating_point() else tensor


FP8_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".input_scale_ub")
"""Tensors of an fp8 checkpoint beside ``X.weight``: its scale (read with it) and activation scales (unused)."""


def fp8_checkpoint_format(hf_config: dict) -> str | None:
    """``"compressed-tensors"`` or ``"fbgemm_fp8"`` where ``config.json``'s ``quantization_config`` says the
    linear weights are stored as float8 codes with scales; None for any other checkpoint."""
    quantization = hf_config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    if method == "fbgemm_fp8":
        return method
    if method == "compressed-tensors":
        for group in (quantization.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                return method
    return None


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

        files = weight_files(Path(source.path))
        fp8_format = fp8_checkpoint_format(source.hf_config)
        scales: dict[str, torch.Tensor] = {}
        if fp8_format is not None:  # scales are small, and may sit in another shard than their weight
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    scales.update(
                        (name.removesuffix("_scale"), handle.get_tensor(name))
                        for name in handle.keys()
                        if name.endswith(".weight_scale")
                    )
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    stored = handle.get_slice(name)
                    if fp8_format is not None and name.endswith(FP8_SCALE_SUFFIXES):
                        continue
                    if name in scales and stored.get_dtype() == "F8_E4M3":
                        yield name, Fp8Weight(stored, scales[name], dtype, name, fp8_format)
                    else:
                        yield name, SafetensorsSlice(stored, dtype)


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


class Fp8Weight(QuantizedWeight):
    """A linear weight of an fp8 checkpoint: float8_e4m3fn codes and their float32 scales (per output channel, or
    one for the tensor), read together; ``load``/``narrow`` give ``codes * scale`` in the asked dtype."""

    def __init__(self, stored: object, scale: torch.Tensor, dtype: str, name: str, checkpoint_format: str) -> None:
        self.stored = stored
        self.dtype = dtype
        self.shape = tuple(stored.get_shape())
        self.format = f"fp8_e4m3 ({checkpoint_format})"
        scale = scale.float().reshape(-1)
        rows = self.shape[0]
        if scale.numel() not in (1, rows):
            raise ValueError(
                f"checkpoint tensor {name!r}_scale has {scale.numel()} scales for {rows} rows: only per-channel and "
                f"per-tensor fp8 scales are read (block-wise ones are not); convert the checkpoint or load another"
            )
        self.scales = scale.expand(rows).reshape(rows, 1).contiguous()

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        scales = self.scales if dim != 0 else self.scales[start : start + length]
        return cast(self.stored[index].float() * scales, self.dtype)

    def load(self) -> torch.Tensor:
        return cast(self.stored[:].float() * self.scales, self.dtype)

    def group_affine(self) -> GroupAffine:
        return GroupAffine(self.stored[:], self.scales, None, self.shape[1], 8, True, self.format)
