"""Can a decode step's attention (memory-bound) run beside its GEMMs (compute-bound) on a second stream?

The Llama-3-8B decode step of `bench/gpu_engine.py`'s workload (512 rows, about 640 tokens of context
each) as bare layers: the QKV GEMM, Weft's Triton paged attention over a random bf16 KV cache, the
output projection and the MLP (RMS norms in place of the model's). Three variants, each captured in one
CUDA graph and replayed: all 512 rows at once; two halves of 256 one after the other; the two halves
software-pipelined over two streams, the attention of one half on a second stream while the GEMMs of
the other run (NanoFlow's nano-batches, without SM partitioning). Printed: the per-layer time of each
part, the step time of each variant, and the ratio of the serial step to the overlapped one.

Usage (on the GPU machine, with weft-core and weft-triton installed):
  python3 bench/gpu_decode_overlap.py [LAYERS]
"""

import sys
import time

import torch
import torch.nn.functional as F

from weft.contracts.attention import AttentionBatch, AttentionLayer
from weft_triton.paged_attention import PagedAttentionKernel

torch.manual_seed(0)
dev = torch.device("cuda")
H, KVH, D, INTER, LAYERS = 4096, 8, 128, 14336, int(sys.argv[1]) if len(sys.argv) > 1 else 32
R = 512
BS = 16
dt = torch.bfloat16
layer = AttentionLayer(num_heads=32, num_kv_heads=8, head_dim=128, scale=D**-0.5)
kern = PagedAttentionKernel()
seq = torch.randint(513, 769, (R,), dtype=torch.int32)
blocks_per = (seq + BS - 1) // BS
maxb = int(blocks_per.max())
nblocks = int(blocks_per.sum())
NC = 2
caches = [torch.randn(2, nblocks, BS, KVH, D, dtype=dt, device=dev) for _ in range(NC)]
perm = torch.randperm(nblocks, dtype=torch.int32)
table = torch.zeros(R, maxb, dtype=torch.int32)
o = 0
for i in range(R):
    n = int(blocks_per[i])
    table[i, :n] = perm[o : o + n]
    o += n


def batch(lo, hi):
    n = hi - lo
    return AttentionBatch(
        query_start=torch.arange(n + 1, dtype=torch.int32, device=dev),
        seq_lens=seq[lo:hi].to(dev),
        block_table=table[lo:hi].to(dev).contiguous(),
        slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev),
        max_query_len=1,
        max_seq_len=768,
        block_size=BS,
    )


NW = 2
W = [
    dict(
        qkv=torch.randn(6144, H, dtype=dt, device=dev) * 0.01,
        o=torch.randn(H, H, dtype=dt, device=dev) * 0.01,
        gu=torch.randn(2 * INTER, H, dtype=dt, device=dev) * 0.01,
        d=torch.randn(H, INTER, dtype=dt, device=dev) * 0.01,
    )
    for _ in range(NW)
]
full = batch(0, R)
halves = [batch(0, R // 2), batch(R // 2, R)]
x_full = F.rms_norm(torch.randn(R, H, dtype=dt, device=dev), (H,))


def qkv(x, layer_index):
    return F.linear(x, W[layer_index % NW]["qkv"])


def attn(qkvo, layer_index, b):
    q = qkvo[:, :H].view(-1, 32, D).contiguous()
    out = torch.empty_like(q)
    kern(
        dtype=dt,
        layer=layer,
        block_size=BS,
        block_m=16,
        splits=1,
        query=q,
        kv_cache=caches[layer_index % NC],
        output=out,
        batch=b,
    )
    return out.view(-1, H)


def mlp(a, x, layer_index):
    w = W[layer_index % NW]
    h = x + F.linear(a, w["o"])
    gu = F.linear(F.rms_norm(h, (H,)), w["gu"])
    g, u = gu.chunk(2, -1)
    return F.rms_norm(h + F.linear(F.silu(g) * u, w["d"]), (H,))


def serial(x):
    for layer_index in range(LAYERS):
        t = qkv(x, layer_index)
        a = attn(t, layer_index, full)
        x = mlp(a, x, layer_index)
    return x


def serial_halves(x):
    xs = list(x.chunk(2))
    for layer_index in range(LAYERS):
        for i in range(2):
            t = qkv(xs[i], layer_index)
            a = attn(t, layer_index, halves[i])
            xs[i] = mlp(a, xs[i], layer_index)
    return torch.cat(xs)


s_att = torch.cuda.Stream()


def overlapped(x):
    main = torch.cuda.current_stream()
    xs = list(x.chunk(2))
    s_att.wait_stream(main)
    t = [None, None]
    a = [None, None]
    ev_t = [None, None]
    ev_a = [None, None]

    def launch_attn(i, layer_index):
        ev_t[i] = torch.cuda.Event()
        ev_t[i].record(main)
        with torch.cuda.stream(s_att):
            s_att.wait_event(ev_t[i])
            a[i] = attn(t[i], layer_index, halves[i])
            ev_a[i] = torch.cuda.Event()
            ev_a[i].record(s_att)

    t[0] = qkv(xs[0], 0)
    launch_attn(0, 0)
    t[1] = qkv(xs[1], 0)
    launch_attn(1, 0)
    for layer_index in range(LAYERS):
        for i in range(2):
            main.wait_event(ev_a[i])
            xs[i] = mlp(a[i], xs[i], layer_index)
            if layer_index + 1 < LAYERS:
                t[i] = qkv(xs[i], layer_index + 1)
                launch_attn(i, layer_index + 1)
    main.wait_stream(s_att)
    return torch.cat(xs)


def bench(fn, name):
    x = x_full.clone()
    for _ in range(2):
        fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn(x)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / n * 1e3
    print(f"{name:16s} {ms:7.3f} ms per {LAYERS}-layer step", flush=True)
    return y, ms


def parts():
    x = x_full.clone()
    t = qkv(x, 0)
    for name, fn in (
        ("qkv", lambda: qkv(x, 0)),
        ("attn", lambda: attn(t, 0, full)),
        ("o+mlp", lambda: mlp(t[:, :H], x, 0)),
    ):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        print(f"  {name:8s} {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms/layer")


parts()
ys, a = bench(serial, "serial 512")
yh, b = bench(serial_halves, "serial 2x256")
yo, c = bench(overlapped, "overlap 2x256")
print("max |halves - overlapped|", (yh.float() - yo.float()).abs().max().item(), "(the same math: 0)")
print(f"serial 512 / overlapped: {a / c:.3f}x; serial 2x256 / overlapped: {b / c:.3f}x")
