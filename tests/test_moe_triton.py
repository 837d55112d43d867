"""weft-triton's fused MoE: pairs sorted by expert and grouped GEMMs, equal to core's ``moe`` reference under the
Triton interpreter on the CPU (float32; the interpreter computes in numpy, which has no bfloat16) and on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from weft.builtins.moe import MoETorch  # noqa: E402
from weft.kernels.warmup import RuntimeMonitor, compile_many  # noqa: E402
from weft.layers.moe import MoERouting  # noqa: E402
from weft.testing import OpContract  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU"
)


def test_sort_pairs_groups_by_expert_in_padded_tiles():
    from weft_triton.fused_moe import max_tiles, sort_pairs

    # 5 tokens, top-2, over experts 2..5 of 8 (this rank holds 4, from expert 2): experts 0, 1, 6, 7 are
    # another rank's, expert 4 gets no token.
    experts = torch.tensor([[2, 0], [3, 2], [5, 7], [2, 3], [1, 6]])
    sorted_pairs, tile_experts = sort_pairs(experts, num_experts=4, first_expert=2, block_m=2)
    tiles = tile_experts.numel()
    assert tiles == max_tiles(10, 4, 2)
    runs = {}
    for tile in range(tiles):
        pairs = sorted_pairs[2 * tile : 2 * tile + 2].tolist()
        expert = tile_experts[tile].item()
        if expert < 0:
            assert all(pair == 10 for pair in pairs)
            continue
        runs.setdefault(expert, []).extend(pair for pair in pairs if pair < 10)
        assert all(experts.flatten()[pair].item() - 2 == expert for pair in pairs if pair < 10)
    assert runs == {0: [0, 3, 6], 1: [2, 7], 3: [4]}  # stable: pairs in token order within an expert


@interpreted
def test_fused_experts_match_the_reference_interpreted():
    """Every float32 example of the reference: many experts, top-k of 1, 2, 4 and 8, experts with no token,
    biases and gpt-oss's activation, sigmoid and grouped routing, a shared expert, another rank's experts."""
    from weft_triton.fused_moe import FusedMoEKernel, fused_moe

    reference = MoETorch(None)
    checked = 0
    for args, kwargs in MoETorch.example_inputs("cpu"):
        if args[0].dtype != torch.float32:
            continue
        kernel = FusedMoEKernel(RuntimeMonitor("error"))
        hidden, _, w13, w2, routing = args
        kernel.add(hidden.dtype, w13.shape[0], routing.top_k, hidden.shape[1], w2.shape[2], "w13_bias" in kwargs)
        compile_many(kernel, kernel.warmup_keys())

        def experts_function(*arguments, kernel=kernel):
            return fused_moe(kernel, *arguments)

        from weft.layers.moe import moe

        actual = moe(*args, experts_function=experts_function, **kwargs)
        torch.testing.assert_close(actual, reference(*args, **kwargs), rtol=1e-4, atol=1e-4)
        assert kernel.monitor.misses == []  # warm-up compiled every variant the calls needed
        checked += 1
    assert checked >= 30


@interpreted
def test_a_batch_that_gives_most_experts_no_token_interpreted():
    from weft_triton.fused_moe import FusedMoEKernel, fused_moe

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 32, generator=generator)
    w13 = torch.randn(64, 48, 32, generator=generator) / 6
    w2 = torch.randn(64, 32, 24, generator=generator) / 5
    logits = torch.randn(3, 64, generator=generator)
    kernel = FusedMoEKernel(RuntimeMonitor("error"))
    kernel.add(torch.float32, 64, 8, 32, 24, False)
    compile_many(kernel, kernel.warmup_keys())
    from weft.layers.moe import moe

    routing = MoERouting(top_k=8)
    actual = moe(hidden, logits, w13, w2, routing, experts_function=lambda *a: fused_moe(kernel, *a))
    torch.testing.assert_close(actual, MoETorch(None)(hidden, logits, w13, w2, routing), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs an NVIDIA GPU"
)
class TestMoETritonOnGPU(OpContract):
    plugin_name = "moe.triton"
    device = "cuda"
