"""Probe (issue 44, GPU only): where a speculative verify step through the Triton attention departs from plain
decoding. 1) The Triton kernel on verify-like batches (8 requests, 40-100 cached tokens, 1-5 new) against
softmax attention in float32. 2) Plain greedy decoding with every step forced through the prefill launch
(block_m 64) against the decode launch."""

import sys

import torch

sys.path.insert(0, "tests")
from weft.contracts.attention import AttentionBatch, AttentionLayer
from weft.contracts.kv_cache import FullAttentionSpec
from weft.testing.suites import _reference_attention
from weft_triton import attention as triton_attention

if torch.cuda.is_available():
    from weft_cuda.platform import CudaPlatform as Platform
else:  # TRITON_INTERPRET=1 on the CPU
    from weft.builtins.cpu import CpuPlatform as Platform
backend = triton_attention.TritonAttention(None, Platform())
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
for head_dim, heads, kv_heads in ((16, 4, 2), (128, 32, 8)):
    layer = AttentionLayer(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, scale=head_dim**-0.5)
    backend.prepare([layer], str(DTYPE).removeprefix("torch."))
    name = str(DTYPE).removeprefix("torch.")
    spec = FullAttentionSpec(block_size=16, dtype=name, num_kv_heads=kv_heads, head_dim=head_dim)
    per = 8
    cache = torch.zeros(backend.kv_cache_shape(8 * per, spec), dtype=DTYPE, device=device)
    g = torch.Generator().manual_seed(0)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(8)]
    cached = torch.randint(40, 100, (8,), generator=g).tolist()
    history = []
    # step 1: prefill each request's cached tokens
    for step_kind in ("prefill", "verify", "decode"):
        if step_kind == "prefill":
            rows = [(r, 0, cached[r]) for r in range(8)]
        elif step_kind == "verify":
            rows = [(r, cached[r], 1 + r % 5) for r in range(8)]
        else:  # one token each after the verify step's: the split-key decode launch
            rows = [(r, cached[r] + 1 + r % 5, 1) for r in range(8)]
        total = sum(n for _, _, n in rows)
        q = torch.randn(total, heads, head_dim, generator=g).to(DTYPE).to(device)
        k = torch.randn(total, kv_heads, head_dim, generator=g).to(DTYPE).to(device)
        v = torch.randn(total, kv_heads, head_dim, generator=g).to(DTYPE).to(device)
        starts, slots = [0], []
        for r, c, n in rows:
            slots += [tables[r][p // 16] * 16 + p % 16 for p in range(c, c + n)]
            starts.append(starts[-1] + n)
        batch = AttentionBatch(
            query_start=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([c + n for _, c, n in rows], dtype=torch.int32, device=device),
            block_table=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
            max_query_len=max(n for _, _, n in rows),
            max_seq_len=max(c + n for _, c, n in rows),
            block_size=16,
        )
        out = backend.forward(layer, q, k, v, cache, backend.build_metadata(batch))
        worst = 0.0
        for i, (r, c, _n) in enumerate(rows):
            sl = slice(starts[i], starts[i + 1])
            if step_kind == "prefill":
                history.append((k[sl].float().cpu(), v[sl].float().cpu()))
                keys, values = history[r]
            else:
                history[r] = (
                    torch.cat([history[r][0], k[sl].float().cpu()]),
                    torch.cat([history[r][1], v[sl].float().cpu()]),
                )
                keys, values = history[r]
            expected = _reference_attention(q[sl].float().cpu(), keys, values, c, layer)
            worst = max(worst, (out[sl].float().cpu() - expected).abs().max().item())
        launch = backend.build_metadata(batch)
        print(
            f"head_dim {head_dim} heads {heads}/{kv_heads} {step_kind} (block_m {launch.block_m}, splits "
            f"{launch.splits}): max |triton - reference| {worst:.4f}",
            flush=True,
        )


if torch.cuda.is_available():  # 2) plain greedy decoding, every step through the prefill launch
    from pathlib import Path

    from conftest import make_tiny_model
    from test_speculative import repetitive_prompts
    from weft import LLM, SamplingParams

    folder = make_tiny_model(Path("/tmp/probe_model"), "llama", Path(".whl/tokenizer"), vocab_size=512)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = repetitive_prompts(8)
    engine = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2, "max_model_len": 512, "enforce_eager": True}
    results = {}
    original = triton_attention.TritonAttention.build_metadata
    for name, metadata in (
        ("decode launch", original),
        ("prefill launch", lambda self, batch: triton_attention.TritonAttentionMetadata(batch=batch, block_m=64)),
    ):
        triton_attention.TritonAttention.build_metadata = metadata
        llm = LLM(model=str(folder), engine=engine)
        results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.close()
    same = [a == b for a, b in zip(results["decode launch"], results["prefill launch"], strict=True)]
    print(f"plain greedy, decode launch vs prefill launch: requests equal {same}")
    for a, b in zip(results["decode launch"], results["prefill launch"], strict=True):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            print(f"  first difference at token {first}: {a[first - 2 : first + 3]} vs {b[first - 2 : first + 3]}")
