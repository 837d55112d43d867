"""The decode top-k selector with the arch forced to gfx950: the single-CTA path against the multi-chunk path.

On gfx950 with topk 16 and a capacity of at most 128 blocks, weft-triton's launch policy runs one CTA per
row (1 chunk, a tile of 128, 2 warps, 1 stage) instead of 16 chunks of 512 (the published change measured
about 28% faster on an MI355). Triton runs the same kernel on NVIDIA, so forcing the arch (the ROCm
platform's ``arch`` option) runs the gfx950 policy here; the speed of an MI355 is not measured by this.

For each shape (heads x decode rows, capacity) both geometries run on the same scores (random, with NaN,
+/-Inf and +/-0 mixed in, and many ties): their outputs must be bit-identical to each other and to the
torch reference, and the completion counters zero. Each is then timed as 50 launches captured in one
CUDA graph (launch overhead out of the way), median of 7 replays; the table gives microseconds per
launch and the multi-chunk / single-CTA ratio (above 1: the single CTA is faster).

Usage: python bench/gpu_decode_topk.py
"""

from __future__ import annotations

import statistics

import torch

from weft.builtins.decode_topk import DecodeTopKTorch
from weft_rocm.platform import RocmPlatform
from weft_triton.decode_topk_policy import DecodeTopKLaunch
from weft_triton.ops import DecodeTopKTriton

SHAPES = [
    # heads, decode rows (total_q), capacity in blocks
    (1, 1, 128),
    (1, 64, 128),
    (8, 64, 128),
    (16, 256, 128),
    (64, 256, 128),
    (8, 64, 64),
    (64, 512, 74),
]
MULTI_CHUNK = DecodeTopKLaunch(chunks=16, block=512, warps=4, stages=1)
LAUNCHES_PER_GRAPH = 50


def scores_for(heads: int, rows: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(heads * 1000 + rows + capacity)
    scores = torch.randint(-8, 9, (heads, rows, capacity), generator=generator).float()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    picks = torch.randint(0, special.numel(), scores.shape, generator=generator)
    scores = torch.where(torch.rand(scores.shape, generator=generator) < 0.1, special[picks], scores)
    seq_lens = torch.randint(1, capacity + 1, (rows,), generator=generator, dtype=torch.int32)
    seq_lens[0] = capacity
    return scores, seq_lens


def graph_time(run) -> float:
    """Median seconds per launch of ``run`` over 7 replays of a graph of LAUNCHES_PER_GRAPH launches."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES_PER_GRAPH):
            run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / LAUNCHES_PER_GRAPH)
    return statistics.median(times)


def main() -> None:
    print(
        f"device: {torch.cuda.get_device_name()}; arch forced to gfx950 (ROCm platform option); topk 16, block_size 1"
    )
    print(f"{'heads':>5} {'rows':>5} {'capacity':>8} {'policy':>34} {'single us':>10} {'16x512 us':>10} {'ratio':>6}")
    platform = RocmPlatform(RocmPlatform.Options(arch="gfx950"))
    ratios = []
    for heads, rows, capacity in SHAPES:
        scores, seq_lens = scores_for(heads, rows, capacity)
        expected = DecodeTopKTorch(None)(scores, seq_lens, 1, 1, 16)
        scores, seq_lens = scores.cuda(), seq_lens.cuda()
        single_op, multi_op = DecodeTopKTriton(platform), DecodeTopKTriton(platform)
        policy = single_op.launch_for(scores, 16)
        assert policy.single_cta, policy
        single = single_op(scores, seq_lens, 1, 1, 16)
        multi = multi_op(scores, seq_lens, 1, 1, 16, launch=MULTI_CHUNK)
        assert torch.equal(single, multi) and torch.equal(single.cpu(), expected), (heads, rows, capacity)
        assert multi_op.counters.eq(0).all()
        single_time = graph_time(lambda op=single_op, s=scores, n=seq_lens: op(s, n, 1, 1, 16))
        multi_time = graph_time(lambda op=multi_op, s=scores, n=seq_lens: op(s, n, 1, 1, 16, launch=MULTI_CHUNK))
        assert multi_op.counters.eq(0).all() and torch.equal(single_op(scores, seq_lens, 1, 1, 16), multi)
        ratios.append(multi_time / single_time)
        print(
            f"{heads:>5} {rows:>5} {capacity:>8} {str(tuple(policy)):>34} {single_time * 1e6:>10.2f} "
            f"{multi_time * 1e6:>10.2f} {ratios[-1]:>6.2f}"
        )
    geomean = statistics.geometric_mean(ratios)
    print(
        f"multi-chunk / single-CTA time, geometric mean over the shapes: {geomean:.2f}x "
        f"(the single CTA takes {100 / geomean:.0f}% of the multi-chunk time); outputs bit-identical and counters "
        "zero on every shape. MI355 (the published ~28%) is not measured here."
    )


if __name__ == "__main__":
    main()
