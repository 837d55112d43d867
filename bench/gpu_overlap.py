"""The engine's decode step at batch 512 on the Llama-3-8B shape: plain against two nano-batches (decode overlap).

``engine.decode_overlap`` splits a captured decode step into two nano-batches and issues one's attention on a second
stream while the other's GEMMs run (docs/cuda.md, "Attention beside the GEMMs"). This bench measures it in the
engine itself, on its own CUDA graphs: one ``LLM`` (random bf16 weights, the 8B shape), its decode graph of 512 rows
captured whole, then as nano-batches, replayed over the same staged step (512 requests of 513-768 tokens in
context, as in the 512 x (512, 256) workload's decode; distinct KV blocks each).

Printed, in order:

1. The step plain (what the engine runs by default) and overlapped: ms per step, and the ratio.
2. Its parts, each as a CUDA graph of its own over the same rows: the GEMM side (the whole step with every row at
   one token of context: projections, MLP, LM head, norms, and attention that reads nothing), the attention side
   (every layer's paged attention alone, the step's real contexts); their sum (the serial step) and their
   larger (the overlap bound), and where the plain and the overlapped step sit between them.
3. With ``--carveouts``: the overlapped step captured with cuBLAS told to leave ``S`` SMs to the attention
   (``torch._C._set_sm_carveout_experimental``; the GEMMs then run on the rest), one line per ``S``.
4. Agreement: the largest |difference| between the plain and overlapped steps' logits, and the share of rows whose
   greedy token is the same.

Usage (on the GPU machine, weft-core, weft-triton and weft-cuda installed):
  python3 bench/gpu_overlap.py --tokenizer DIR [--batch 512] [--carveouts 0,16,32]
"""

from __future__ import annotations

import argparse
import json

import torch

from gpu_common import LLAMA3_8B, MemoryLoader, cuda_time, out_path, random_weights, registry_with_memory_loader
from weft import LLM
from weft.contracts.attention import AttentionBatch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tokenizer", required=True, help="a folder of Hugging Face tokenizer files")
parser.add_argument("--batch", type=int, default=512)
parser.add_argument("--carveouts", default="16,32", help="SMs cuBLAS leaves free, comma-separated ('' for none)")
parser.add_argument("--repeats", type=int, default=20)
args = parser.parse_args()

R = args.batch
SMS = torch.cuda.get_device_properties(0).multi_processor_count
print(f"# decode overlap in the engine: {torch.cuda.get_device_name()} ({SMS} SMs), torch {torch.__version__}")
model = MemoryLoader.add("llama-3-8b", LLAMA3_8B, random_weights(LLAMA3_8B, torch.bfloat16), args.tokenizer)
llm = LLM(
    model=model,
    registry=registry_with_memory_loader(),
    use={"platform": "cuda"},
    engine={"dtype": "bfloat16", "max_num_seqs": R, "graph_batch_sizes": [R], "decode_overlap": False},
)
worker = llm.engine.worker
runner = llm.engine.runner
graphs = runner.decode_graphs
platform = worker.platform
assert list(graphs.graphs) == [R] and graphs.split_from is None, "the plain engine captured its 512-row graph whole"
group = graphs.groups[0]
block_size = group.spec.block_size
cache = next(iter(graphs.kv_caches.values()))
usable_blocks = min(graphs.scratch_blocks)  # the scratch block is each cache's last; every block before is free

generator = torch.Generator().manual_seed(0)
context = torch.randint(513, 769, (R,), generator=generator)
blocks_each = (context + block_size - 1) // block_size
needed = int(blocks_each.sum())
if needed > usable_blocks:
    raise SystemExit(f"the KV cache holds {usable_blocks} blocks; 512 rows of 513-768 tokens need {needed}")
order = torch.randperm(usable_blocks, generator=generator)[:needed].tolist()
tables, offset = [], 0
for count in blocks_each.tolist():
    tables.append(order[offset : offset + count])
    offset += count
real_positions = (context - 1).tolist()
tokens = torch.randint(0, LLAMA3_8B["vocab_size"], (R,), generator=generator)
kv_gb = 2 * int(context.sum()) * LLAMA3_8B["num_key_value_heads"] * LLAMA3_8B["head_dim"] * 2 * 32 / 1e9
print(f"the step: {R} rows, {int(context.sum()):,} tokens in context ({kv_gb:.1f} GB of KV read a step)")


def stage(whole_context: bool) -> None:
    """Stage the step's rows in the graph's static buffers: at their real context, or each at one token."""
    if whole_context:
        graphs._stage_replay(real_positions, [tables], R)
    else:
        graphs._stage_replay([0] * R, [[table[:1] for table in tables]], R)
    graphs.static.input_ids[:R].copy_(tokens)


def replay_ms() -> tuple[float, torch.Tensor]:
    replay = graphs.graphs[R]
    for _ in range(3):
        replay()
    ms = cuda_time(replay, args.repeats) * 1e3
    return ms, replay().float().clone()


def capture(split_from: int | None) -> None:
    graphs.graphs.clear()
    graphs.logits.clear()
    torch.cuda.synchronize()
    with torch.inference_mode():
        graphs.capture(platform, [R], graphs.scratch_blocks, graphs.max_model_len, split_from)


results: dict = {"device": torch.cuda.get_device_name(), "sms": SMS, "batch": R, "kv_gb": kv_gb}

# 1. Plain and overlapped.
stage(True)
plain_ms, plain_logits = replay_ms()
stage(False)
gemm_ms, _ = replay_ms()  # every row at one token of context: the step without its KV reads
capture(R)
stage(True)
overlap_ms, overlap_logits = replay_ms()
print(f"1. plain step {plain_ms:.3f} ms, overlapped (two nano-batches of {R // 2}) {overlap_ms:.3f} ms: "
      f"{plain_ms / overlap_ms:.3f}x")  # fmt: skip

# 2. The GEMM side and the attention side.
layers = [runner.model.model.layers[index] for index in runner.model.model.stage_layers]
query = torch.randn(R, 32, 128, dtype=torch.bfloat16, device="cuda")
key = torch.randn(R, 8, 128, dtype=torch.bfloat16, device="cuda")
value = torch.randn(R, 8, 128, dtype=torch.bfloat16, device="cuda")


def attention_only() -> torch.Tensor:
    static = graphs.static
    batch = AttentionBatch(
        query_start=static.query_start[: R + 1],
        seq_lens=static.seq_lens[:R],
        block_table=static.block_tables[0][:R],
        slot_mapping=static.slot_mappings[0][:R],
        max_query_len=1,
        max_seq_len=graphs.max_model_len,
        block_size=block_size,
    )
    forward_context = graphs._static_context([graphs.backend.build_metadata(batch)], [batch])
    output = query
    for layer in layers:
        output = layer.self_attn.attend(output, key, value, forward_context)
    return output


with torch.inference_mode():
    attention_replay = platform.capture_graph(attention_only)
for _ in range(3):
    attention_replay()
attention_ms = cuda_time(attention_replay, args.repeats) * 1e3
serial, bound = gemm_ms + attention_ms, max(gemm_ms, attention_ms)
print(
    f"2. GEMM side (the step at one token of context) {gemm_ms:.3f} ms, attention side (32 layers' paged attention) "
    f"{attention_ms:.3f} ms ({kv_gb / attention_ms * 1e3:,.0f} GB/s of KV); "
    f"serial {serial:.3f} ms, overlap bound (the larger) {bound:.3f} ms: the bound is {serial / bound:.3f}x serial. "
    f"Plain step = {plain_ms / serial:.3f} of serial, overlapped = {overlap_ms / serial:.3f} of serial, "
    f"{overlap_ms / bound:.3f}x the bound"
)
results.update(plain_ms=plain_ms, overlap_ms=overlap_ms, gemm_ms=gemm_ms, attention_ms=attention_ms)
results.update(serial_ms=serial, bound_ms=bound)

# 3. With SMs carved out of cuBLAS.
carveouts = [int(value) for value in args.carveouts.split(",") if value.strip()]
if carveouts and not hasattr(torch._C, "_set_sm_carveout_experimental"):
    print("3. this torch has no _set_sm_carveout_experimental: no carve-out lines")
    carveouts = []
results["carveout_ms"] = {}
for sms in carveouts:
    torch._C._set_sm_carveout_experimental(sms)
    try:
        capture(R)
    finally:
        torch._C._set_sm_carveout_experimental(None)
    stage(True)
    ms, _ = replay_ms()
    results["carveout_ms"][sms] = ms
    print(f"3. overlapped, cuBLAS leaving {sms} of {SMS} SMs: {ms:.3f} ms, {plain_ms / ms:.3f}x plain")

# 4. Agreement.
difference = (overlap_logits - plain_logits).abs().max().item()
same = (overlap_logits.argmax(-1) == plain_logits.argmax(-1)).float().mean().item()
print(f"4. overlapped against plain logits: max |difference| {difference:.3e}, same greedy token on {same:.1%} of rows")
best = min([overlap_ms, *results["carveout_ms"].values()])
print(
    f"verdict: best overlapped step {best:.3f} ms against plain {plain_ms:.3f} ms ({plain_ms / best:.3f}x); "
    f"decode-only rate at {R} rows: plain {R * 1e3 / plain_ms:,.0f} tok/s, best overlapped {R * 1e3 / best:,.0f} tok/s"
)
results.update(max_logit_difference=difference, same_greedy=same)
path = out_path("gpu_overlap.json")
if path:
    path.write_text(json.dumps(results, indent=1))
llm.close()
