"""The Triton attention backend on an NVIDIA GPU: end-to-end parity with the torch backend, and kernel speed.

1. Parity: a tiny random Llama (GQA, sliding window off/on) generates greedily through the
   engine with ``use.attention = "torch"`` and ``"triton"`` (float32); the token ids must match.
2. Speed, one attention layer of a Llama-3-8B shape (32 query / 8 KV heads, head_dim 128,
   bf16, block 16): a decode step of 64 requests x 2048 context, against the HBM roofline
   (KV bytes read / copy bandwidth measured in this run) and the torch backend; and a
   prefill of 4 chunks of 1024 tokens on 1024 cached ones, in TFLOP/s.

Usage: python bench/gpu_attention.py --tokenizer DIR   (a folder with tokenizer.json)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch


def tiny_model(folder: Path, tokenizer: Path, window: int | None) -> Path:
    from safetensors.torch import save_file

    hidden, layers, heads, kv_heads, head_dim, vocab = 256, 4, 8, 2, 64, 49152
    config = {
        "architectures": ["MistralForCausalLM" if window else "LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
        "sliding_window": window,
    }
    generator = torch.Generator().manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    tensors = {
        "model.embed_tokens.weight": weight(vocab, hidden),
        "lm_head.weight": weight(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for index in range(layers):
        prefix = f"model.layers.{index}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": weight(512, hidden),
            prefix + "mlp.up_proj.weight": weight(512, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, 512),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def parity(tokenizer: Path) -> None:
    from weft import LLM, SamplingParams

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (1, 5, 17, 33, 64, 100, 250, 400)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with tempfile.TemporaryDirectory() as root:
        for window in (None, 48):
            folder = tiny_model(Path(root) / f"w{window}", tokenizer, window)
            results = {}
            for backend in ("torch", "triton"):
                llm = LLM(
                    model=str(folder),
                    use={"platform": "cuda", "attention": backend},
                    engine={"dtype": "float32", "num_kv_blocks": 1024, "block_size": 16, "max_num_batched_tokens": 256},
                )
                results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                del llm
            same = sum(a == b for a, b in zip(results["torch"], results["triton"], strict=False))
            print(
                f"parity window={window}: {same}/{len(prompts)} prompts give identical greedy tokens (48 each)",
                flush=True,
            )


def copy_bandwidth() -> float:
    source = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del source, target
    return 2 * (4 << 30) / seconds


def time_forward(backend, layer, query, key, value, cache, metadata) -> float:
    for _ in range(3):
        backend.forward(layer, query, key, value, cache, metadata)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        backend.forward(layer, query, key, value, cache, metadata)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / 20


def speed() -> None:
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionBatch, AttentionLayer
    from weft_cuda.platform import CudaPlatform
    from weft_triton.attention import TritonAttention

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    platform = CudaPlatform()
    layer = AttentionLayer(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5)
    block = 16
    for label, requests, cached, new in (
        ("decode 64 x 2048", 64, 2047, 1),
        ("prefill 4 x 1024 on 1024", 4, 1024, 1024),
    ):
        context = cached + new
        per_request = -(-context // block)
        num_blocks = requests * per_request
        cache = torch.randn(2, num_blocks, block, 8, 128, dtype=torch.bfloat16, device="cuda")
        table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(requests, per_request)
        positions = torch.arange(cached, context, device="cuda")
        slots = (table[:, positions // block].long() * block + positions % block).flatten().to(torch.int32)
        batch = AttentionBatch(
            query_start=torch.arange(0, requests * new + 1, new, dtype=torch.int32, device="cuda"),
            seq_lens=torch.full((requests,), context, dtype=torch.int32, device="cuda"),
            block_table=table,
            slot_mapping=slots,
            max_query_len=new,
            max_seq_len=context,
            block_size=block,
        )
        tokens = requests * new
        query = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device="cuda")
        key = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
        value = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
        timings = {}
        outputs = {}
        for name, backend in (("triton", TritonAttention(None, platform)), ("torch", TorchAttention(None, platform))):
            backend.prepare([layer], "bfloat16")
            metadata = backend.build_metadata(batch)
            outputs[name] = backend.forward(layer, query, key, value, cache, metadata).float()
            timings[name] = time_forward(backend, layer, query, key, value, cache, metadata)
        error = (outputs["triton"] - outputs["torch"]).abs().max().item()
        kv_bytes = 2 * requests * context * 8 * 128 * 2
        flops = 4 * requests * 32 * 128 * (new * cached + new * (new + 1) / 2)
        roofline = kv_bytes / bandwidth
        print(
            f"{label}: triton {timings['triton'] * 1e3:.3f} ms, torch backend {timings['torch'] * 1e3:.3f} ms "
            f"(triton {timings['torch'] / timings['triton']:.1f}x faster); KV roofline {roofline * 1e3:.3f} ms "
            f"(triton at {roofline / timings['triton']:.0%}); {flops / timings['triton'] / 1e12:.1f} TFLOP/s; "
            f"max |triton - torch| {error:.3g}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    args = parser.parse_args()
    print(f"# gpu_attention: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    speed()
    parity(args.tokenizer)


if __name__ == "__main__":
    main()
