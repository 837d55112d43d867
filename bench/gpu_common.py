"""Shared pieces of the GPU benchmarks and GPU tests.

* Ceilings measured in the same run: device-to-device copy bandwidth, and the
  bf16 matmul rate on large random matrices.
* Model shapes (Llama-3-8B, Qwen3-0.6B) as Hugging Face config dicts.
* Random-weight models that never touch the disk: :class:`MemoryLoader` is a
  weight-loader plugin serving a config and a weight iterator registered in
  this process (random tensors made on the GPU, or a Hugging Face model's own
  state dict so both run identical weights); :func:`registry_with_memory_loader`
  adds it to the installed plugins. :class:`RandomLoader` serves ``random:<shape>``
  in every process, worker processes included (:func:`install_random_loader`):
  each makes the same seeded tensors on its own GPU.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from weft.contracts.loader import ModelSource, WeightLoader
from weft.plugins import PluginRegistry
from weft.plugins.discovery import PluginEntry, discover

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=16384,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=128000,
    eos_token_id=128001,
)
"""Llama-3-8B's shape (context cut to 16k: the benchmarks need no more)."""

QWEN3_0_6B: dict[str, Any] = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
)


def out_path(name: str) -> Path | None:
    """``$OUT/name`` when $OUT is set (the device machine's output folder)."""
    root = os.environ.get("OUT")
    return Path(root) / name if root else None


def copy_bandwidth(gigabytes: int = 4) -> float:
    """Bytes per second of a device-to-device copy (read + write), a practical HBM ceiling."""
    size = gigabytes << 30
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    seconds = cuda_time(lambda: target.copy_(source), repeats=10)
    return 2 * size / seconds


def matmul_rate(size: int = 8192) -> float:
    """FLOP/s of a bf16 ``size``-cubed matmul on random data (cuBLAS)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    seconds = cuda_time(lambda: a @ b, repeats=20)
    return 2 * size**3 / seconds


def cuda_time(fn: Callable[[], Any], repeats: int) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` back-to-back calls, timed with CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def hf_generate(model, prompts: torch.Tensor, output: int) -> float:
    """Seconds of HF ``generate()``: greedy, exactly ``output`` new tokens per prompt (EOS disabled), one batch."""
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=output, min_new_tokens=output, eos_token_id=None, pad_token_id=0)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert generated.shape[1] == prompts.shape[1] + output, generated.shape
    return seconds


def hf_config(shape: dict[str, Any]):
    from transformers import AutoConfig

    spec = dict(shape)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def hf_parameter_shapes(shape: dict[str, Any]) -> list[tuple[str, torch.Size]]:
    """Names and shapes of a Hugging Face model's parameters, from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(shape))
    return [(name, parameter.shape) for name, parameter in model.named_parameters()]


def random_weights(
    shape: dict[str, Any], dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> Callable[[], Iterator]:
    """A weight iterator of random tensors made on the GPU: N(0, std) matrices, norms of ones."""

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        for name, size in hf_parameter_shapes(shape):
            if name.endswith("norm.weight"):
                yield name, torch.ones(size, dtype=dtype, device="cuda")
            else:
                yield name, torch.empty(size, dtype=dtype, device="cuda").normal_(0, std, generator=generator)

    return weights


class MemoryLoader(WeightLoader):
    """Serves models registered in this process: ``memory:<name>``."""

    name: ClassVar[str] = "memory"
    priority: ClassVar[int] = 100
    models: ClassVar[dict[str, tuple[dict[str, Any], Callable[[], Iterator], Path]]] = {}

    @classmethod
    def add(cls, name: str, shape: dict[str, Any], weights: Callable[[], Iterator], tokenizer: Path) -> str:
        cls.models[name] = (shape, weights, tokenizer)
        return f"memory:{name}"

    def accepts(self, source: str) -> bool:
        return source.startswith("memory:") and source[7:] in self.models

    def resolve(self, source: str) -> ModelSource:
        shape, _, tokenizer = self.models[source[7:]]
        config = {key: value for key, value in shape.items()}
        return ModelSource(path=str(tokenizer), format="memory", hf_config=config, tokenizer="hf", name=source)

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        _, weights, _ = self.models[source.name[7:]]
        for name, tensor in weights():
            yield name, tensor.to(getattr(torch, dtype))


SMOLLM2_135M: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B,
    "qwen3-0.6b": QWEN3_0_6B,
    "smollm2-135m": SMOLLM2_135M,
    # Llama-3-8B's layers over SmolLM2's vocabulary (bench/structured_output.py: its grammar needs SmolLM2's tokenizer).
    "llama3-8b-smollm2-vocab": {**LLAMA3_8B, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2},
}


class RandomLoader(WeightLoader):
    """``random:<shape>`` (a name in :data:`SHAPES`): seeded N(0, 0.02) bf16 weights made on the loading
    process's GPU, the same in every process; SmolLM2's tokenizer from ``$WEFT_TEST_TOKENIZER``."""

    name: ClassVar[str] = "random"
    priority: ClassVar[int] = 100

    def accepts(self, source: str) -> bool:
        return source.startswith("random:") and source[7:] in SHAPES

    def resolve(self, source: str) -> ModelSource:
        tokenizer = os.environ["WEFT_TEST_TOKENIZER"]
        return ModelSource(
            path=tokenizer, format="random", hf_config=dict(SHAPES[source[7:]]), tokenizer="hf", name=source
        )

    def iter_weights(self, source: ModelSource, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in random_weights(SHAPES[source.name[7:]], torch.bfloat16)():
            yield name, tensor.to(getattr(torch, dtype))


def install_random_loader(folder: Path) -> None:
    """Make :class:`RandomLoader` an installed plugin (a distribution in ``folder``, put on ``sys.path``), so that
    the worker processes of a multi-process engine, which discover plugins themselves, find it too."""
    import importlib
    import sys

    dist_info = folder / "weft_bench_random-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: weft-bench-random\nVersion: 0\nRequires-Dist: weft-core>=1.0,<2\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[weft.loader]\nrandom = {__name__}:RandomLoader\n")
    bench = str(Path(__file__).resolve().parent)
    for entry in (str(folder), bench):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), bench, os.environ.get("PYTHONPATH", "")]))
    importlib.invalidate_caches()


def registry_with_memory_loader() -> PluginRegistry:
    entry = PluginEntry(
        slot="loader",
        name="memory",
        target=f"{__name__}:MemoryLoader",
        distribution="weft-bench",
        version="0",
        core_api="",
        builtin=False,
    )
    return PluginRegistry(discover() + [entry])
