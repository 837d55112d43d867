"""The decode block top-k op (shared/reference/ops.md): the torch reference against a plain
Python ordering, and weft-cuda's Triton kernel against the reference, on the CPU under Triton's
interpreter and on an NVIDIA GPU (including CUDA-graph replay)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from weft.builtins.decode_topk import NAN_SCORE, DecodeTopKTorch
from weft.testing import OpContract

NAN_SCORE_FP32 = float(torch.tensor(NAN_SCORE, dtype=torch.float32))  # scores compare in fp32
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 1e30, -1e30, 2.5]


def python_topk(scores: torch.Tensor, seq_lens: list[int], q: int, block_size: int, topk: int) -> list:
    """The op's definition, one row at a time, with Python's sort."""
    heads, total_q, max_block = scores.shape
    result = []
    for head in range(heads):
        rows = []
        for b in range(total_q):
            position = seq_lens[b // q] - q + b % q
            visible = min(math.ceil(max(position + 1, 0) / block_size), max_block)

            row = [float(value) for value in scores[head, b, :visible]]
            row = [NAN_SCORE_FP32 if math.isnan(value) else value + 0.0 for value in row]
            chosen = sorted(range(visible), key=lambda block, row=row: (-row[block], block))[:topk]
            rows.append(chosen + [-1] * (topk - len(chosen)))
        result.append(rows)
    return result


def random_case(seed: int, heads: int, reqs: int, q: int, max_block: int, block_size: int, special_share: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(-4, 5, (heads, reqs * q, max_block), generator=generator).float()  # many exact ties
    special = torch.tensor(SPECIAL)
    picks = torch.randint(0, len(SPECIAL), scores.shape, generator=generator)
    scores = torch.where(torch.rand(scores.shape, generator=generator) < special_share, special[picks], scores)
    seq_lens = torch.randint(0, max_block * block_size + 3, (reqs,), generator=generator, dtype=torch.int32)
    return scores, seq_lens


CASES = [
    # heads, reqs, q, capacity (max_block), block_size, topk
    (1, 3, 1, 0, 4, 4),
    (2, 2, 1, 1, 4, 4),
    (1, 4, 1, 74, 1, 16),
    (2, 3, 2, 128, 2, 16),
    (1, 3, 1, 129, 1, 16),
    (1, 2, 3, 40, 16, 8),
    (1, 2, 1, 300, 1, 512),
]


@pytest.mark.parametrize("case", CASES, ids=[f"cap{case[3]}-topk{case[5]}" for case in CASES])
def test_reference_follows_the_definition(case):
    heads, reqs, q, capacity, block_size, topk = case
    scores, seq_lens = random_case(sum(case), heads, reqs, q, capacity, block_size)
    got = DecodeTopKTorch(None)(scores, seq_lens, q, block_size, topk)
    assert got.dtype == torch.int32 and got.shape == (heads, reqs * q, topk)
    assert got.tolist() == python_topk(scores, seq_lens.tolist(), q, block_size, topk)


def test_reference_properties_on_a_large_capacity():
    scores, seq_lens = random_case(5, 2, 3, 1, 8192, 1)
    seq_lens[0] = 0
    seq_lens[1] = 8192
    got = DecodeTopKTorch(None)(scores, seq_lens, 1, 1, 64)
    canonical = torch.where(torch.isnan(scores), torch.full_like(scores, NAN_SCORE), scores)
    for head in range(2):
        for row, length in enumerate(seq_lens.tolist()):
            kept = [block for block in got[head, row].tolist() if block >= 0]
            assert len(kept) == len(set(kept)) == min(64, length)
            assert all(0 <= block < length for block in kept)
            assert got[head, row, len(kept):].eq(-1).all()
            if kept and len(kept) < length:
                dropped = sorted(set(range(length)) - set(kept))
                assert canonical[head, row, dropped].max() <= canonical[head, row, kept].min()


def test_signed_zeros_tie_and_nan_ranks_as_minus_1e30_above_minus_inf():
    scores = torch.tensor([[[0.0, -0.0, float("nan"), -float("inf"), float("inf"), -0.0]]])
    got = DecodeTopKTorch(None)(scores, torch.tensor([6], dtype=torch.int32), 1, 1, 8)
    assert got.tolist() == [[[4, 0, 1, 5, 2, 3, -1, -1]]]


def test_bad_shapes_are_refused_with_the_fields_named():
    with pytest.raises(ValueError, match="total_q"):
        DecodeTopKTorch(None)(torch.zeros(1, 3, 4), torch.tensor([4, 4], dtype=torch.int32), 1, 1, 2)
    with pytest.raises(ValueError, match="scores must be"):
        DecodeTopKTorch(None)(torch.zeros(3, 4), torch.tensor([4], dtype=torch.int32), 1, 1, 2)


triton_cases = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")


@triton_cases
@pytest.mark.parametrize("case", CASES, ids=[f"cap{case[3]}-topk{case[5]}" for case in CASES])
def test_triton_kernel_interpreted_equals_the_reference(case):
    pytest.importorskip("triton")
    from weft_cuda.decode_topk import DecodeTopKTriton

    heads, reqs, q, capacity, block_size, topk = case
    scores, seq_lens = random_case(sum(case) + 1, heads, reqs, q, capacity, block_size)
    kernel = DecodeTopKTriton(None)
    got = kernel(scores, seq_lens, q, block_size, topk)
    torch.testing.assert_close(got, DecodeTopKTorch(None)(scores, seq_lens, q, block_size, topk), rtol=0, atol=0)
    if kernel.counters is not None:
        assert kernel.counters.eq(0).all()


@triton_cases
def test_triton_single_chunk_equals_many_chunks(monkeypatch):
    pytest.importorskip("triton")
    from weft_cuda import decode_topk as module

    scores, seq_lens = random_case(11, 1, 4, 1, 129, 1)
    many = module.DecodeTopKTriton(None)(scores, seq_lens, 1, 1, 16)
    assert module.launch_shape(129, 16)[2] > 1
    monkeypatch.setattr(module, "MIN_CHUNK", 256)
    assert module.launch_shape(129, 16)[2] == 1
    single = module.DecodeTopKTriton(None)(scores, seq_lens, 1, 1, 16)
    assert torch.equal(single, many)
    assert torch.equal(single, DecodeTopKTorch(None)(scores, seq_lens, 1, 1, 16))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(4, 8, 1, 8192, 1, 512), (2, 16, 2, 2048, 4, 64)], ids=str)
def test_triton_kernel_on_gpu_equals_the_reference(case, dtype):
    from weft_cuda.decode_topk import DecodeTopKTriton

    heads, reqs, q, capacity, block_size, topk = case
    scores, seq_lens = random_case(sum(case) + 2, heads, reqs, q, capacity, block_size)
    scores = scores.to(dtype)
    expected = DecodeTopKTorch(None)(scores, seq_lens, q, block_size, topk)
    kernel = DecodeTopKTriton(None)
    got = kernel(scores.cuda(), seq_lens.cuda(), q, block_size, topk).cpu()
    assert torch.equal(got, expected)
    if kernel.counters is not None:
        assert kernel.counters.eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
def test_cuda_graph_replay_gives_the_same_result_and_leaves_counters_at_zero():
    from weft_cuda.decode_topk import DecodeTopKTriton

    scores, seq_lens = random_case(21, 2, 6, 1, 4096, 1)
    scores, seq_lens = scores.cuda(), seq_lens.cuda()
    kernel = DecodeTopKTriton(None)
    kernel(scores, seq_lens, 1, 1, 128)  # compile and allocate the workspace outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel(scores, seq_lens, 1, 1, 128)
    for seed in (22, 23, 24):
        fresh, _ = random_case(seed, 2, 6, 1, 4096, 1)
        scores.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.cpu(), DecodeTopKTorch(None)(fresh, seq_lens.cpu(), 1, 1, 128))
        assert kernel.counters.eq(0).all()


class TestDecodeTopKTorchContract(OpContract):
    plugin_name = "decode_topk.torch"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
class TestDecodeTopKTritonContractOnGPU(OpContract):
    plugin_name = "decode_topk.triton"
    device = "cuda"
