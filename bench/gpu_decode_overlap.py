"""Can a decode step's attention (memory-bound) run beside its GEMMs (compute-bound)? Attention's share of the step.

The Llama-3-8B decode step of `bench/gpu_engine.py`'s workload (512 rows, 513-768 tokens of context each) as bare
layers: the QKV GEMM, Weft's Triton paged attention over a random bf16 KV cache, the output projection and the MLP
(RMS norms in place of the model's). Every variant is one CUDA graph of ``--layers`` layers, replayed.

Printed, in order:

1. Attention's share of the step: per layer, the QKV GEMM, the attention (bf16 cache, and an fp8 cache), the
   output projection + MLP; the serial step (their sum) against the overlap bound (the larger of GEMMs and
   attention), and attention's share of the serial step.
2. What each side gets from part of the GPU: attention on ``P`` programs (``bench/bounded_attention.py``, a
   persistent kernel that takes at most ``P`` CTA slots), and the GEMMs with ``S`` SMs carved out of cuBLAS
   (``torch._C._set_sm_carveout_experimental``: cuBLAS's SM count target); the bandwidth and matmul shares that
   decide whether a partition can beat the serial step.
3. The step, per variant: all 512 rows (what the engine runs); two halves of 256, one after the other; the two
   halves software-pipelined over two streams (the attention of one half beside the GEMMs of the other: NanoFlow's
   nano-batches) with no partition; and, for each partition ``S`` of ``--partitions``, the pipelined halves with
   the attention on ``P`` = S or 2S programs beside GEMMs (a) carved out of S SMs, (b) the same with the attention
   stream at high priority, (c) on a green context of the other SMs (``torch.cuda.green_contexts``, where this
   torch has them; timed eagerly if a green context's stream cannot be captured). Each line gives the step time,
   its ratio to the serial step, and its largest difference from the serial halves' output (the same math).
4. The best variant against the serial step and the overlap bound: the figure docs/cuda.md's choice rests on.

Usage (on the GPU machine, with weft-core and weft-triton installed):
  python3 bench/gpu_decode_overlap.py [--layers 32] [--partitions 16,32,48,64]
"""

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from bounded_attention import bounded_decode_attention, check
from gpu_common import out_path
from weft.contracts.attention import AttentionBatch, AttentionLayer, to_float8
from weft_triton.paged_attention import PagedAttentionKernel

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--layers", type=int, default=32)
parser.add_argument("--partitions", default="16,32,48,64", help="SMs given to the attention, comma-separated")
args = parser.parse_args()

torch.manual_seed(0)
dev = torch.device("cuda")
H, KVH, D, INTER, LAYERS = 4096, 8, 128, 14336, args.layers
R = 512
BS = 16
dt = torch.bfloat16
SMS = torch.cuda.get_device_properties(dev).multi_processor_count
print(f"# decode overlap: {torch.cuda.get_device_name()} ({SMS} SMs), torch {torch.__version__}, {LAYERS} layers")
layer = AttentionLayer(num_heads=32, num_kv_heads=8, head_dim=128, scale=D**-0.5)
kern = PagedAttentionKernel()
kern.cache_dtypes.append(torch.float8_e4m3fn)
seq = torch.randint(513, 769, (R,), dtype=torch.int32)
blocks_per = (seq + BS - 1) // BS
maxb = int(blocks_per.max())
nblocks = int(blocks_per.sum())
NC = 2
caches = [torch.randn(2, nblocks, BS, KVH, D, dtype=dt, device=dev) for _ in range(NC)]
fp8_caches = [to_float8(cache) for cache in caches]
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
results: dict = {"device": torch.cuda.get_device_name(), "sms": SMS, "layers": LAYERS}


def qkv(x, layer_index):
    return F.linear(x, W[layer_index % NW]["qkv"])


def attn(qkvo, layer_index, b, programs=None, fp8=False):
    """The step's attention: weft-triton's kernel, or the bounded one on ``programs`` programs."""
    q = qkvo[:, :H].view(-1, 32, D).contiguous()
    out = torch.empty_like(q)
    cache = (fp8_caches if fp8 else caches)[layer_index % NC]
    if programs is not None:
        bounded_decode_attention(layer, q, cache, out, b, programs)
        return out.view(-1, H)
    kern(
        dtype=dt,
        layer=layer,
        block_size=BS,
        block_m=16,
        splits=1,
        query=q,
        kv_cache=cache,
        output=out,
        batch=b,
        cache_dtype=cache.dtype if fp8 else None,
    )
    return out.view(-1, H)


def mlp(a, x, layer_index):
    w = W[layer_index % NW]
    h = x + F.linear(a, w["o"])
    gu = F.linear(F.rms_norm(h, (H,)), w["gu"])
    g, u = gu.chunk(2, -1)
    return F.rms_norm(h + F.linear(F.silu(g) * u, w["d"]), (H,))


def serial(x, fp8=False):
    for layer_index in range(LAYERS):
        t = qkv(x, layer_index)
        a = attn(t, layer_index, full, fp8=fp8)
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


def overlapped(x, s_att, programs=None, gemm_stream=None):
    """The two halves pipelined: the GEMMs on ``gemm_stream`` (the current stream if None), the attention on
    ``s_att`` (on ``programs`` programs if set)."""
    outer = torch.cuda.current_stream()
    main = gemm_stream or outer
    if main is not outer:
        main.wait_stream(outer)
    with torch.cuda.stream(main):
        xs = list(x.chunk(2))
        s_att.wait_stream(main)
        t = [None, None]
        a = [None, None]
        ev_a = [None, None]

        def launch_attn(i, layer_index):
            ev_t = torch.cuda.Event()
            ev_t.record(main)
            with torch.cuda.stream(s_att):
                s_att.wait_event(ev_t)
                a[i] = attn(t[i], layer_index, halves[i], programs)
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
        y = torch.cat(xs)
    if main is not outer:
        outer.wait_stream(main)
    return y


def graph_ms(fn):
    """Milliseconds per replay of ``fn`` captured in one CUDA graph, and its output."""
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
    return (time.perf_counter() - t0) / n * 1e3, y


def eager_ms(fn):
    x = x_full.clone()
    for _ in range(2):
        fn(x)
    torch.cuda.synchronize()
    n = 10
    t0 = time.perf_counter()
    for _ in range(n):
        y = fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3, y


def per_layer_ms(fn, repeats=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


class carveout:
    """cuBLAS's GEMMs leave ``sms`` SMs free (torch's experimental SM carve-out) inside the block."""

    def __init__(self, sms):
        self.sms = sms

    def __enter__(self):
        if CARVEOUT:
            torch._C._set_sm_carveout_experimental(self.sms)

    def __exit__(self, *exc):
        if CARVEOUT:
            torch._C._set_sm_carveout_experimental(None)


CARVEOUT = hasattr(torch._C, "_set_sm_carveout_experimental")
if not CARVEOUT:
    print("  (this torch has no _set_sm_carveout_experimental: the 'carved' lines below run on the full GPU)")


green_contexts_kept = []


def green_stream(sms):
    """A stream of a green context holding ``sms`` SMs, or the reason there is none."""
    from torch.cuda import green_contexts

    if not getattr(green_contexts, "SUPPORTED", False):
        return None, "this torch has no green contexts"
    try:
        context = green_contexts.GreenContext.create(num_sms=sms, device_id=0)
        if not hasattr(context, "Stream"):
            # Older green contexts only run work on the context's null stream while the context is pushed:
            # nothing to run beside the attention's stream, nor to capture.
            return None, "this torch's GreenContext has no Stream() (only set_context on the null stream)"
        green_contexts_kept.append(context)  # the stream lives as long as its context
        return context.Stream(), None
    except Exception as error:  # noqa: BLE001 - any failure is a finding to print
        return None, f"{type(error).__name__}: {error}"


# 1. Attention's share of the step.
x = x_full.clone()
t = qkv(x, 0)
layer_ms = {
    "qkv": per_layer_ms(lambda: qkv(x, 0)),
    "attention": per_layer_ms(lambda: attn(t, 0, full)),
    "attention_fp8_kv": per_layer_ms(lambda: attn(t, 0, full, fp8=True)),
    "o_mlp": per_layer_ms(lambda: mlp(t[:, :H], x, 0)),
}
results["per_layer_ms"] = layer_ms
gemm_ms = layer_ms["qkv"] + layer_ms["o_mlp"]
kv_bytes = 2 * int(seq.sum()) * KVH * D * 2
print("1. attention's share of a 512-row decode step (per layer, eager):")
for name, ms in layer_ms.items():
    print(f"  {name:18s} {ms:.3f} ms")
print(
    f"  attention reads {kv_bytes / 1e9:.3f} GB a layer: {kv_bytes / layer_ms['attention'] / 1e9:.0f} GB/s (bf16), "
    f"{kv_bytes / 2 / layer_ms['attention_fp8_kv'] / 1e9:.0f} GB/s (fp8)"
)
print(
    f"  serial (sum) {gemm_ms + layer_ms['attention']:.3f} ms, overlap bound (larger) "
    f"{max(gemm_ms, layer_ms['attention']):.3f} ms a layer; attention is "
    f"{layer_ms['attention'] / (gemm_ms + layer_ms['attention']):.1%} of the serial step (with an fp8 cache "
    f"{layer_ms['attention_fp8_kv'] / (gemm_ms + layer_ms['attention_fp8_kv']):.1%})"
)

# 2. What each side gets from part of the GPU.
difference = check("cuda", 64, layer, BS, 16, dt)
print(f"2. bounded attention against weft-triton's kernel: max |difference| {difference:.2e}")
assert difference < 2e-2, difference
partitions = [int(value) for value in args.partitions.split(",")]
bounded, carved = {}, {}
for sms in [*partitions, SMS]:
    for programs in sorted({sms, 2 * sms}):
        bounded[programs] = per_layer_ms(lambda programs=programs: attn(t, 0, full, programs))
for sms in partitions:
    with carveout(sms):
        carved[sms] = per_layer_ms(lambda: (qkv(x, 0), mlp(t[:, :H], x, 0)))
results["bounded_attention_ms"], results["carved_gemm_ms"] = bounded, carved
for programs, ms in sorted(bounded.items()):
    print(
        f"  attention on {programs:4d} programs: {ms:.3f} ms a layer "
        f"({layer_ms['attention'] / ms:.0%} of weft-triton's kernel's rate)"
    )
for sms, ms in carved.items():
    print(
        f"  GEMMs with {sms:3d} of {SMS} SMs carved out: {ms:.3f} ms a layer ({gemm_ms / ms:.0%} of the full "
        f"GPU's rate); with attention on {sms} programs beside them the layer could take "
        f"{max(ms, bounded[sms]):.3f} ms"
        + (" (no slower than the full GPU: the carve-out did not reach these GEMMs)" if ms < 1.02 * gemm_ms else "")
    )

# 3. The step, per variant.
print(f"3. the {LAYERS}-layer step (one CUDA graph, replayed):")
steps: dict[str, float] = {}
ms_serial, y_serial = graph_ms(serial)
ms_halves, y_halves = graph_ms(serial_halves)
steps["serial 512"], steps["serial 2x256"] = ms_serial, ms_halves
steps["serial 512, fp8 KV"], _ = graph_ms(lambda x: serial(x, fp8=True))


def report(name, ms, y, note=""):
    steps[name] = ms
    gap = (y.float() - y_halves.float()).abs().max().item()
    print(f"  {name:44s} {ms:7.3f} ms  {ms_serial / ms:.3f}x serial  max |diff| {gap:.1e}{note}", flush=True)


print(f"  {'serial 512 (what the engine runs)':44s} {ms_serial:7.3f} ms")
print(f"  {'serial 2x256':44s} {ms_halves:7.3f} ms  {ms_serial / ms_halves:.3f}x serial")
print(f"  {'serial 512 with an fp8 KV cache':44s} {steps['serial 512, fp8 KV']:7.3f} ms")
s_att = torch.cuda.Stream()
s_att_high = torch.cuda.Stream(priority=-100)  # out of range: mapped to the highest priority
report("overlap 2x256, no partition", *graph_ms(lambda x: overlapped(x, s_att)))
for sms in partitions:
    for programs in (sms, 2 * sms):
        with carveout(sms):
            for stream, note in ((s_att, ""), (s_att_high, ", high prio")):
                run = functools.partial(overlapped, s_att=stream, programs=programs)
                report(f"overlap, {sms} SMs carved, attn on {programs}{note}", *graph_ms(run))
    gemm_stream, reason = green_stream(SMS - sms)
    if gemm_stream is None:
        print(f"  green context of {SMS - sms} SMs for the GEMMs: none ({reason})")
        continue
    name = f"overlap, GEMMs on green {SMS - sms} SMs, attn on {sms}"
    run = functools.partial(overlapped, s_att=s_att, programs=sms, gemm_stream=gemm_stream)
    try:
        report(name, *graph_ms(run))
    except Exception as error:  # noqa: BLE001 - not capturable: time it eagerly and say so
        torch.cuda.synchronize()
        report(name, *eager_ms(run), f"  (eager: {error})")
results["step_ms"] = steps

# 4. The verdict.
best = min((name for name in steps if name.startswith("overlap")), key=steps.__getitem__)
bound = max(gemm_ms, layer_ms["attention"]) * LAYERS
print(
    f"4. best overlap: {best!r}, {steps[best]:.3f} ms against the serial step's {ms_serial:.3f} ms "
    f"({ms_serial / steps[best]:.3f}x; the overlap bound {bound:.3f} ms would be {ms_serial / bound:.3f}x). "
    f"Engine-level equivalent at 256 output tokens a request: serial {R * 1e3 / ms_serial:,.0f} tok/s, "
    f"best overlap {R * 1e3 / steps[best]:,.0f} tok/s (decode steps only, no prefill)"
)
results["best"] = best
path = out_path("gpu_decode_overlap.json")
if path:
    path.write_text(json.dumps(results, indent=1))
