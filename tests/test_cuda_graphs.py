"""Decode graphs and kernel warm-up through the engine.

On the CPU (Triton interpreted) the runner's graph path runs with a platform
whose "capture" replays the forward eagerly: the static buffers, the padding to
the captured size and the scratch block are exercised, and greedy tokens must
equal an eager engine's. On an NVIDIA GPU the same comparison runs with real
CUDA graphs, and a mixed workload under ``runtime_jit = "error"`` must compile
no Triton kernel after warm-up.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import make_tiny_model
from weft import LLM, SamplingParams

pytest.importorskip("triton")

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU"
)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (count,), generator=generator).tolist()
    return [torch.randint(3, 49152, (length,), generator=generator).tolist() for length in lengths]


def staggered(count: int, longest: int) -> list[SamplingParams]:
    """Requests that finish at different steps, so the decode batch shrinks through padded sizes."""
    return [SamplingParams(temperature=0, max_tokens=longest - 3 * i, ignore_eos=True) for i in range(count)]


def token_ids(outputs):
    return [output.outputs[0].token_ids for output in outputs]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "llama", "llama", tokenizer_files)


@pytest.fixture(scope="module")
def tiny_window(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("graphs") / "mistral", "mistral-window", tokenizer_files)


@interpreted
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_window"])
def test_padded_graph_path_equals_eager(model, request, eager_replay_platform):
    folder = str(request.getfixturevalue(model))
    engine = {"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8}
    batch, params = prompts(5), staggered(5, 14)  # the Triton kernels interpreted: short, yet down through 8, 4, 2, 1
    eager = LLM(model=folder, use={"attention": "triton"}, engine={**engine, "enforce_eager": True})
    expected = token_ids(eager.generate(batch, params))
    assert not eager_replay_platform
    graphs = LLM(model=folder, use={"attention": "triton"}, engine={**engine, "graph_batch_sizes": [1, 2, 4, 8]})
    assert sorted(graphs.engine.runner.graphs) == [1, 2, 4, 8]
    assert token_ids(graphs.generate(batch, params)) == expected
    assert len(eager_replay_platform) >= 13  # every decode step replayed (batch 5 padded to 8, down to 1)
    # Scratch rows never touch the manager's blocks: another run still matches.
    assert token_ids(graphs.generate(batch[:3], params[:3])) == expected[:3]


@interpreted
def test_warm_up_compiles_every_variant_before_serving(tiny_llama):
    llm = LLM(
        model=str(tiny_llama),
        use={"attention": "triton"},
        engine={"block_size": 4, "num_kv_blocks": 256, "runtime_jit": "error", "max_num_batched_tokens": 16},
    )
    kernel = llm.engine.worker.kernels.kernels["weft_triton.paged_attention"]
    assert len(kernel.compiled) == 3  # one layer shape and block size: decode, split-key decode, prefill
    # Chunked prefill, prefill mixed with decodes, decode-only steps: no miss (error mode would raise).
    llm.generate(prompts(4), staggered(4, 12))
    assert kernel.monitor.misses == [] and kernel.monitor.mode == "error"


def test_graph_sizes_beyond_max_num_seqs_are_refused(tiny_llama, eager_replay_platform):
    with pytest.raises(
        ValueError, match=r"engine.graph_batch_sizes = \[1, 64\]: \[64\] exceed engine.max_num_seqs = 8"
    ):
        LLM(
            model=str(tiny_llama),
            use={"attention": "triton"},
            engine={"num_kv_blocks": 64, "max_num_seqs": 8, "graph_batch_sizes": [64, 1]},
        )


# On an NVIDIA GPU: real CUDA graphs, real compilation.


def triton_compiled_variants() -> int:
    from weft_triton.paged_attention import _paged_attention_kernel

    return sum(len(caches[0]) for caches in _paged_attention_kernel.device_caches.values())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_window"])
def test_cuda_graphs_equal_eager_on_gpu(model, dtype, request):
    folder = str(request.getfixturevalue(model))
    engine = {"block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 32, "dtype": dtype}
    batch, params = prompts(20, seed=11), staggered(20, 70)
    eager = LLM(model=folder, use={"platform": "cuda"}, engine={**engine, "enforce_eager": True})
    expected = token_ids(eager.generate(batch, params))
    graphs = LLM(model=folder, use={"platform": "cuda"}, engine=engine)
    assert graphs.engine.runner.graphs and graphs.engine.worker.attention.name == "triton"
    assert token_ids(graphs.generate(batch, params)) == expected


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nano_batch_graphs_equal_plain_graphs_on_gpu(tiny_llama, dtype):
    """engine.decode_overlap: decode graphs of 8 rows and more captured as two nano-batches, the attention of one
    on a second CUDA stream, give the greedy tokens of the plain graphs."""
    engine = {"block_size": 16, "num_kv_blocks": 512, "max_num_seqs": 32, "dtype": dtype}
    batch, params = prompts(20, seed=11), staggered(20, 70)
    plain = LLM(model=str(tiny_llama), use={"platform": "cuda"}, engine={**engine, "decode_overlap": False})
    assert plain.engine.runner.graphs and plain.engine.runner.decode_graphs.split_from is None
    expected = token_ids(plain.generate(batch, params))
    plain.close()
    split = LLM(
        model=str(tiny_llama),
        use={"platform": "cuda"},
        engine={**engine, "decode_overlap": True, "decode_overlap_min_batch": 8},
    )
    assert split.engine.runner.decode_graphs.split_from == 8
    assert type(split.engine.worker.ops["nano_batches"]).__name__ == "NanoBatchesStreams"
    assert token_ids(split.generate(batch, params)) == expected
    split.close()


@pytest.mark.gpu
@needs_gpu
def test_no_kernel_compiles_after_warm_up_on_gpu(tiny_window):
    """A scripted serving workload under runtime_jit = "error" compiles nothing once the engine is up."""
    llm = LLM(
        model=str(tiny_window),
        use={"platform": "cuda"},
        engine={"dtype": "bfloat16", "runtime_jit": "error", "max_num_batched_tokens": 64, "max_num_seqs": 16},
    )
    before = triton_compiled_variants()
    assert before > 0
    workload = prompts(24, seed=21) + [list(range(100, 400))]  # a long prompt: chunked prefill beside decodes
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5 + i) for i in range(len(workload))]
    outputs = llm.generate(workload, params)
    assert all(output.outputs[0].token_ids for output in outputs)
    assert llm.engine.worker.kernels.kernels["weft_triton.paged_attention"].monitor.misses == []
    assert triton_compiled_variants() == before
