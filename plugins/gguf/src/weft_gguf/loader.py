"""The "gguf" loader: a GGUF file (or an alias naming one) as a Hugging Face-shaped model.

The config is synthesised from the GGUF metadata, the generation config from its
``general.sampling.*`` keys (else what :data:`~weft_gguf.files.ALIAS_GENERATION_CONFIGS`
declares for an alias); tensors are dequantized with
the ``gguf`` package and renamed to Hugging Face names. llama.cpp stores
Llama's q/k projections permuted for its rotary layout; they are permuted back.
Dequantized weights are cached as safetensors under the user's cache folder,
keyed by the file's content hash and the dtype (:func:`weft_gguf.files.file_key`), so a warm start, or
another installation of the same file, skips the work (``weft cache list | clear``); the
cache's checksums (:mod:`weft_gguf.checksum`) are verified on every read, and a
truncated or changed cache is rebuilt with one warning; so is the cached tokenizer. The ranks of a
tensor-parallel engine read only their slices of that file.

torch (and the quantized blocks, which use it) is imported where tensors are made: ``weft serve``'s API
process loads every loader to resolve the model, and imports no torch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from weft.api import bar, human_bytes, report
from weft.contracts.loader import LoadedSlice, ModelSource, WeightLoader, WeightSlice
from weft_gguf import checksum
from weft_gguf.convert import cache_tokenizer
from weft_gguf.files import (
    ALIAS_GENERATION_CONFIGS,
    ALIASES,
    cache_dir,
    file_key,
    resolve_alias,
    tokenizer_cache,
)

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in weft-gguf's name map")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: pairs (0, d/2), (1, d/2+1)... back to halves."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: Any) -> dict[str, Any]:
    """A Hugging Face config.json equivalent from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    names = {tensor.name for tensor in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
"""GGUF sampling metadata -> generation_config.json key (llama.cpp's converter writes the former from the latter)."""


def read_sampling_metadata(reader: Any) -> dict[str, Any]:
    """The recommended sampling settings a GGUF file carries, under generation_config.json's names."""
    return {key: _field(reader, gguf_key) for gguf_key, key in _SAMPLING_KEYS.items() if gguf_key in reader.fields}


def cached_metadata(path: Path, kind: str, read: Any, open_reader: Any) -> dict[str, Any]:
    """``read(reader)`` of a GGUF file (``kind``: its name in the cache), computed once and then kept in the cache
    folder."""
    cached = cache_dir() / "gguf" / f"{file_key(path, kind)}.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text())
        except ValueError:
            warnings.warn(f"weft-gguf: the {kind} cache {cached} is not valid JSON; rebuilding it", stacklevel=2)
    metadata = read(open_reader(path))
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(metadata))
        os.replace(temporary, cached)
    except OSError as error:
        print(f"weft-gguf: could not write the {kind} cache {cached}: {error}", file=sys.stderr)
    return metadata


class GGUFLoader(WeightLoader):
    """GGUF files (llama, qwen2, qwen3), dequantized; and the alias ``smollm2-135m-instruct``."""

    priority: ClassVar[int] = 10

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._readers: dict[str, Any] = {}

    def _reader(self, path: Path | str) -> Any:
        """The parsed GGUF file, opened once per loader (parsing its metadata takes seconds)."""
        import gguf

        key = str(Path(path).resolve())
        if key not in self._readers:
            self._readers[key] = gguf.GGUFReader(key)
        return self._readers[key]

    def accepts(self, source: str) -> bool:
        if source in ALIASES:
            return True
        try:
            return source.endswith(".gguf") and Path(source).expanduser().is_file()
        except OSError:
            return False

    def resolve(self, source: str) -> ModelSource:
        path = resolve_alias(source) if source in ALIASES else Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"model {source!r}: no such GGUF file")
        name = source if source in ALIASES else path.name.removesuffix(".gguf")
        config = cached_metadata(path, "config", read_config, self._reader)
        generation_config = cached_metadata(path, "generation_config", read_sampling_metadata, self._reader)
        # While the file is parsed anyway: its byte-level BPE vocabulary, for the "gguf" tokenizer.
        cache_tokenizer(tokenizer_cache(path), path, lambda: self._reader(path))
        return ModelSource(
            path=str(path.resolve()),
            format="gguf",
            hf_config=config,
            tokenizer="gguf",
            name=name,
            generation_config=generation_config or ALIAS_GENERATION_CONFIGS.get(source, {}),
        )

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, part in self.iter_weight_slices(source, dtype):
            yield name, part.load()

    def iter_weight_slices(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, WeightSlice]]:
        """Slices of the dequantized cache file (written first if absent: the file is dequantized once); under a
        quantization method (``load_config.quantization``), the file's Q4_0/Q4_1/Q4_K/Q8_0 tensors in their blocks."""
        import torch

        if self.load_config.quantization != "none":
            yield from self._quantized_weights(source, getattr(torch, dtype))
            return
        from safetensors import safe_open

        from weft.api import SafetensorsSlice

        cached = cache_dir() / "gguf" / f"{file_key(Path(source.path), dtype)}.safetensors"
        if cached.is_file():
            wrong = checksum.problem(cached)
            if wrong is None:
                with safe_open(str(cached), framework="pt") as handle:
                    for name in handle.keys():
                        yield name, SafetensorsSlice(handle.get_slice(name), dtype)
                return
            warnings.warn(
                f"weft-gguf: the weight cache {cached} is {wrong}; rebuilding it from {source.path}", stacklevel=2
            )
            checksum.remove(cached)
        tensors = self._dequantize(source, getattr(torch, dtype))
        self._readers.pop(str(Path(source.path).resolve()), None)
        if _save_atomically(tensors, cached):
            report(
                "cached for next time: %s (%s; weft cache list shows it, weft cache clear frees it)",
                cached,
                human_bytes(cached.stat().st_size),
            )
        for name, tensor in tensors.items():
            yield name, LoadedSlice(tensor)

    def _quantized_weights(self, source: ModelSource, dtype: torch.dtype) -> Iterator[tuple[str, WeightSlice]]:
        import gguf
        import torch

        from weft_gguf.blocks import GGUFQuantizedWeight, decomposable

        config = source.hf_config
        permute = config["model_type"] == "llama"
        for tensor in self._reader(source.path).tensors:
            name = hf_name(tensor.name)
            heads = None
            if permute and name.endswith("q_proj.weight"):
                heads = config["num_attention_heads"]
            elif permute and name.endswith("k_proj.weight"):
                heads = config["num_key_value_heads"]
            if decomposable(tensor.tensor_type.name):
                yield name, GGUFQuantizedWeight(tensor, dtype, heads)
                continue
            values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
            if heads is not None:
                values = unpermute_rotary(values, heads)
            yield name, LoadedSlice(values.to(dtype).contiguous())

    def _dequantize(self, source: ModelSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        import gguf
        import torch

        reader = self._reader(source.path)
        config = source.hf_config
        permute = config["model_type"] == "llama"
        tensors: dict[str, torch.Tensor] = {}
        label = f"dequantizing {Path(source.path).name} to {str(dtype).removeprefix('torch.')} (first start only)"
        for tensor in bar(reader.tensors, len(reader.tensors), label, "tensors"):
            name = hf_name(tensor.name)
            values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
            if permute and name.endswith("q_proj.weight"):
                values = unpermute_rotary(values, config["num_attention_heads"])
            elif permute and name.endswith("k_proj.weight"):
                values = unpermute_rotary(values, config["num_key_value_heads"])
            tensors[name] = values.to(dtype).contiguous()
        return tensors


def _save_atomically(tensors: dict[str, torch.Tensor], destination: Path) -> bool:
    """Write the cache file and its checksums under temporary names and rename them, so readers never see
    half a file; a file without its checksums (a crash between the renames) is rebuilt. False when it could
    not be written (said on stderr)."""
    from safetensors.torch import save_file

    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        temporary = destination.with_suffix(f".{os.getpid()}.tmp")
        save_file(tensors, str(temporary))
        sums = checksum.record(temporary, destination)
        os.replace(temporary, destination)
        os.replace(sums, checksum.sidecar(destination))
    except OSError as error:
        print(f"weft-gguf: could not write the weight cache {destination}: {error}", file=sys.stderr)
        return False
    return True
