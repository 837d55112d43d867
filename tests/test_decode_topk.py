"""The decode block top-k op (shared semantics in weft.builtins.decode_topk): the torch reference against a
plain Python full-order reference; weft-triton's launch policy as a pure function; its kernel, single-CTA
and multi-chunk, bit-identical to both references with the arch forced to gfx950, on the CPU under Triton's
interpreter and on a GPU (including CUDA-graph replay, with the completion counters back at zero)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from weft.builtins.decode_topk import NAN_SCORE, DecodeTopKTorch
from weft.testing import OpContract
from weft_triton.decode_topk_policy import DecodeTopKLaunch, decode_topk_launch

NAN_SCORE_FP32 = float(torch.tensor(NAN_SCORE, dtype=torch.float32))  # scores compare in fp32
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 1e30, -1e30, 2.5]


def python_topk(scores: torch.Tensor, seq_lens: list[int], q: int, block_size: int, topk: int) -> list:
    """The op's definition, one row at a time, with Python's sort of every visible block (full order)."""
    heads, total_q, max_block = scores.shape
    result = []
    for head in range(heads):
        rows = []
        for b in range(total_q):
            position = seq_lens[b // q] - q + b % q
            visible = min(math.ceil(max(position + 1, 0) / block_size), max_block)
            row = [float(value) for value in scores[head, b, :visible].float()]
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
            assert got[head, row, len(kept) :].eq(-1).all()
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


# The launch policy (pure).

SINGLE_CTA = DecodeTopKLaunch(chunks=1, block=128, warps=2, stages=1)
SIXTEEN_BY_512 = DecodeTopKLaunch(chunks=16, block=512, warps=4, stages=1)


@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        (0, SINGLE_CTA),
        (1, SINGLE_CTA),
        (74, SINGLE_CTA),
        (128, SINGLE_CTA),
        (129, SIXTEEN_BY_512),
        (8192, SIXTEEN_BY_512),
    ],
)
def test_gfx950_policy_at_the_listed_capacities(capacity, expected):
    assert decode_topk_launch("gfx950", 16, capacity, 4, 8) == expected
    assert expected.single_cta == (capacity <= 128)


def test_single_cta_needs_gfx950_and_topk_16():
    for arch, topk in (("gfx942", 16), ("sm_90", 16), ("", 16), ("gfx950", 8), ("gfx950", 32)):
        assert decode_topk_launch(arch, topk, 128, 1, 1).chunks == 16, (arch, topk)


@pytest.mark.parametrize(
    ("rows", "chunks"),
    [
        (1, 16),
        (3, 16),
        (4, 16),
        (5, 8),
        (8, 8),
        (9, 4),
        (16, 4),
        (17, 2),
        (32, 2),
        (33, 1),
        (64, 1),
        (65, 1),
        (4096, 1),
    ],
)
def test_beyond_16_by_512_chunks_are_the_largest_power_of_two_under_64_over_rows(rows, chunks):
    for total_q, heads in ((rows, 1), (1, rows)):
        launch = decode_topk_launch("gfx950", 16, 8193, total_q, heads)
        assert launch.chunks == chunks == 1 << int(math.log2(max(1, min(16, 64 // rows))))
        assert launch.block == 512


def test_policy_tiles_hold_topk_and_refuse_bad_shapes():
    assert decode_topk_launch("gfx950", 2048, 100, 1, 1).block == 2048
    assert decode_topk_launch("sm_90", 600, 20000, 1, 1).block == 1024
    with pytest.raises(ValueError, match="topk"):
        decode_topk_launch("gfx950", 0, 10, 1, 1)


# The Triton kernel, under the interpreter on the CPU (small shapes: the interpreter sorts in Python).

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU"
)


def gfx950_op():
    """weft-triton's op on the ROCm platform with its arch forced to gfx950 (no AMD GPU needed)."""
    pytest.importorskip("triton")
    from weft_rocm.platform import RocmPlatform
    from weft_triton.ops import DecodeTopKTriton

    return DecodeTopKTriton(RocmPlatform(RocmPlatform.Options(arch="gfx950")))


def check_both_references(got, scores, seq_lens, q, block_size, topk):
    assert got.dtype == torch.int32
    assert got.tolist() == python_topk(scores.cpu(), seq_lens.tolist(), q, block_size, topk)
    assert torch.equal(got.cpu(), DecodeTopKTorch(None)(scores.cpu(), seq_lens.cpu(), q, block_size, topk))


KERNEL_CASES = [
    # heads, reqs, q, capacity, block_size, topk, seq_lens (None: random)
    (1, 2, 1, 0, 4, 16, None),
    (1, 2, 1, 1, 4, 16, None),
    (1, 2, 1, 74, 1, 16, [74, 30]),
    (2, 1, 2, 128, 2, 16, [250]),
    (1, 2, 1, 129, 1, 16, [129, 3]),
    (1, 2, 1, 8192, 1, 16, [1100, 600]),  # 3 and 2 busy chunks of 512: the merge in the last CTA to arrive
]


@interpreted
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"cap{case[3]}" for case in KERNEL_CASES])
def test_policy_launch_equals_the_full_order_reference_on_gfx950(case):
    heads, reqs, q, capacity, block_size, topk, lengths = case
    scores, seq_lens = random_case(capacity + 7, heads, reqs, q, capacity, block_size, special_share=0.4)
    if lengths is not None:
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
    op = gfx950_op()
    assert op.launch_for(scores, topk).single_cta == (capacity <= 128)
    check_both_references(op(scores, seq_lens, q, block_size, topk), scores, seq_lens, q, block_size, topk)
    if op.counters is not None:
        assert op.counters.eq(0).all()


GEOMETRIES = [
    SINGLE_CTA,
    SIXTEEN_BY_512,
    DecodeTopKLaunch(chunks=1, block=16, warps=1, stages=1),  # one CTA folding 8 tiles
    DecodeTopKLaunch(chunks=8, block=16, warps=1, stages=1),  # 8 CTAs of one tile, merged
    DecodeTopKLaunch(chunks=2, block=16, warps=1, stages=1),  # 2 CTAs folding 4 tiles each, merged
]


@interpreted
def test_every_geometry_is_bit_identical_to_the_single_cta_result():
    """Capacity 128, topk 16 on gfx950: the policy's single CTA against multi-chunk geometries on the same rows."""
    scores, _ = random_case(3, 1, 3, 1, 128, 1, special_share=0.5)
    scores[0, 0, :6] = torch.tensor([0.0, -0.0, float("nan"), -float("inf"), float("inf"), -0.0])
    seq_lens = torch.tensor([128, 100, 9], dtype=torch.int32)
    op = gfx950_op()
    assert op.launch_for(scores, 16) == SINGLE_CTA
    single = op(scores, seq_lens, 1, 1, 16)
    check_both_references(single, scores, seq_lens, 1, 1, 16)
    for launch in GEOMETRIES[1:]:
        assert torch.equal(op(scores, seq_lens, 1, 1, 16, launch=launch), single), launch
        assert op.counters.eq(0).all(), launch


@interpreted
def test_signed_zeros_infinities_and_nan_order_in_the_kernel():
    scores = torch.tensor([[[0.0, -0.0, float("nan"), -float("inf"), float("inf"), -0.0, -1e30, float("nan")]]])
    seq_lens = torch.tensor([8], dtype=torch.int32)
    op = gfx950_op()
    expected = [[[4, 0, 1, 5, 2, 6, 7, 3] + [-1] * 8]]
    assert op(scores, seq_lens, 1, 1, 16).tolist() == expected
    assert (
        op(scores, seq_lens, 1, 1, 16, launch=DecodeTopKLaunch(chunks=4, block=16, warps=1, stages=1)).tolist()
        == expected
    )


@interpreted
def test_a_geometry_that_cannot_hold_topk_is_refused():
    op = gfx950_op()
    scores, seq_lens = random_case(1, 1, 1, 1, 40, 1)
    with pytest.raises(ValueError, match="topk"):
        op(scores, seq_lens, 1, 1, 16, launch=DecodeTopKLaunch(chunks=2, block=8, warps=1, stages=1))


def test_triton_op_is_chosen_where_the_platform_has_a_triton_backend():
    """The op priorities pick the Triton kernel on ROCm (Triton's AMD backend ships in PyPI's triton) and the
    torch reference on the CPU and on an XPU without Intel's Triton backend."""
    from weft.builtins.cpu import CpuPlatform
    from weft.builtins.decode_topk import DecodeTopKTorch
    from weft.contracts.gpu_platform import triton_backend_installed
    from weft.plugins import PluginRegistry
    from weft.plugins.selection import choose_op
    from weft_rocm.platform import RocmPlatform
    from weft_xpu.platform import XpuPlatform

    registry = PluginRegistry()
    assert isinstance(choose_op(registry, "decode_topk", CpuPlatform()), DecodeTopKTorch)
    for platform_class in (RocmPlatform, XpuPlatform):
        chosen = type(choose_op(registry, "decode_topk", platform_class()))
        has_backend = triton_backend_installed(platform_class.triton_backend)
        assert (chosen.__name__ == "DecodeTopKTriton") == has_backend, (platform_class.name, chosen)
        assert platform_class.default_attention == ("triton" if has_backend else "torch")


# On a GPU.


def _has_cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", CASES + [(4, 8, 1, 8192, 1, 512), (2, 16, 2, 2048, 4, 64), (8, 4, 1, 40000, 1, 16)], ids=str
)
def test_kernel_on_gpu_equals_the_reference(case, dtype):
    from weft_triton.ops import DecodeTopKTriton

    heads, reqs, q, capacity, block_size, topk = case
    scores, seq_lens = random_case(sum(case) + 2, heads, reqs, q, capacity, block_size)
    scores = scores.to(dtype)
    expected = DecodeTopKTorch(None)(scores, seq_lens, q, block_size, topk)
    op = DecodeTopKTriton(None)
    got = op(scores.cuda(), seq_lens.cuda(), q, block_size, topk).cpu()
    assert torch.equal(got, expected)
    if op.counters is not None:
        assert op.counters.eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize("capacity", [1, 74, 128])
def test_gfx950_single_cta_on_gpu_equals_multi_chunk_and_the_full_order_reference(capacity):
    """The arch forced to gfx950 on whatever GPU is here: the policy's single CTA against the 16x512
    path and a merging geometry, on 256 rows with every special value."""
    scores, seq_lens = random_case(capacity, 8, 32, 1, capacity, 1, special_share=0.5)
    op = gfx950_op()
    scores, seq_lens = scores.cuda(), seq_lens.cuda()
    assert op.launch_for(scores, 16) == SINGLE_CTA
    single = op(scores, seq_lens, 1, 1, 16)
    for launch in (SIXTEEN_BY_512, DecodeTopKLaunch(chunks=8, block=16, warps=1, stages=1)):
        assert torch.equal(op(scores, seq_lens, 1, 1, 16, launch=launch), single), launch
        assert op.counters.eq(0).all()
    check_both_references(single.cpu(), scores.cpu(), seq_lens.cpu(), 1, 1, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA or ROCm GPU")
@pytest.mark.parametrize(("capacity", "topk"), [(4096, 128), (128, 16)])
def test_graph_replay_gives_the_same_result_and_leaves_counters_at_zero(capacity, topk):
    """Captured with the arch forced to gfx950: capacity 128 / topk 16 is the single CTA, 4096 the multi-chunk
    merge; each replay on fresh scores equals the reference and leaves every completion counter at zero.
    The single-CTA graph is also checked against a captured multi-chunk launch of the same inputs."""
    scores, seq_lens = random_case(21, 2, 6, 1, capacity, 1)
    scores, seq_lens = scores.cuda(), seq_lens.cuda()
    op, other = gfx950_op(), gfx950_op()
    merging = SIXTEEN_BY_512 if capacity > 512 else DecodeTopKLaunch(chunks=8, block=16, warps=1, stages=1)
    op(scores, seq_lens, 1, 1, topk)  # compile and allocate the workspace outside capture
    other(scores, seq_lens, 1, 1, topk, launch=merging)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(scores, seq_lens, 1, 1, topk)
        captured_other = other(scores, seq_lens, 1, 1, topk, launch=merging)
    for seed in (22, 23, 24):
        fresh, lengths = random_case(seed, 2, 6, 1, capacity, 1)
        scores.copy_(fresh)
        seq_lens.copy_(lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.cpu(), DecodeTopKTorch(None)(fresh, lengths, 1, 1, topk))
        assert torch.equal(captured_other, captured)
        for counters in (op.counters, other.counters):
            assert counters is None or counters.eq(0).all()
    assert other.counters is not None


class TestDecodeTopKTorchContract(OpContract):
    plugin_name = "decode_topk.torch"


@interpreted
def test_a_grown_workspace_keeps_the_one_a_graph_may_have_captured():
    """A launch needing more workspace (here: more chunks for the same rows, as the policy picks for fewer
    rows past 16 x 512 blocks) grows it to at least twice its size and keeps the old buffers alive."""
    import weakref

    from weft_triton.ops import DecodeTopKTriton

    scores, seq_lens = random_case(5, 1, 4, 1, 40, 1)
    op = DecodeTopKTriton(None)
    expected = DecodeTopKTorch(None)(scores, seq_lens, 1, 1, 8)
    assert torch.equal(
        op(scores, seq_lens, 1, 1, 8, launch=DecodeTopKLaunch(chunks=2, block=16, warps=1, stages=1)), expected
    )
    first, counters = weakref.ref(op.launcher.workspace), weakref.ref(op.counters)
    size = op.launcher.workspace.numel()
    assert torch.equal(
        op(scores, seq_lens, 1, 1, 8, launch=DecodeTopKLaunch(chunks=4, block=16, warps=1, stages=1)), expected
    )
    assert op.launcher.workspace.numel() >= 2 * size and first() is not None and first() is not op.launcher.workspace
    assert counters() is op.counters  # as many rows: the counters did not grow
    bigger, lengths = random_case(6, 1, 9, 1, 40, 1)
    assert torch.equal(
        op(bigger, lengths, 1, 1, 8, launch=DecodeTopKLaunch(chunks=4, block=16, warps=1, stages=1)),
        DecodeTopKTorch(None)(bigger, lengths, 1, 1, 8),
    )
    assert counters() is not None and counters() is not op.counters and op.counters.eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA or ROCm GPU")
def test_a_graph_replays_correctly_after_a_later_launch_grew_the_workspace():
    """Captured over a 2-chunk workspace; then an eager 4-chunk launch grows it and the freed-looking memory
    is claimed by a new tensor: the replay still gives the reference and leaves that tensor untouched."""
    from weft_triton.ops import DecodeTopKTriton

    scores, seq_lens = random_case(31, 2, 8, 1, 300, 1)
    scores, seq_lens = scores.cuda(), seq_lens.cuda()
    op = DecodeTopKTriton(None)
    two, four = (DecodeTopKLaunch(chunks=n, block=64, warps=2, stages=1) for n in (2, 4))
    op(scores, seq_lens, 1, 1, 16, launch=two)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(scores, seq_lens, 1, 1, 16, launch=two)
    op(scores, seq_lens, 1, 1, 16, launch=four)
    filler = torch.full((16 * 2 * 16,), 7, dtype=torch.int64, device="cuda")  # the 2-chunk workspace's size
    for seed in (32, 33):
        fresh, lengths = random_case(seed, 2, 8, 1, 300, 1)
        scores.copy_(fresh)
        seq_lens.copy_(lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.cpu(), DecodeTopKTorch(None)(fresh, lengths, 1, 1, 16))
        assert filler.eq(7).all()
        assert op.counters.eq(0).all()
