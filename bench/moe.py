"""Mixture of experts on the GPU: the engine on a Qwen3-30B-A3B shape and the fused MoE kernel, each against a
baseline measured in the same run.

Parts (``--part``, repeatable):

* ``engine``: Qwen3-30B-A3B's shape (48 layers, 128 experts, 8 per token, random bf16 weights), 256 requests x
  (512 prompt, 256 output) tokens, greedy, EOS ignored: ``LLM.generate`` with default engine settings
  against its physical bound (prefill at the bf16 matmul rate over the active parameters; each decode step
  at the larger of its HBM time, the weights of the experts the step's tokens actually touch plus the
  attention and head weights and the KV of every running request at the measured copy bandwidth, and its
  matmul time) and against Hugging Face ``generate()`` on the same weights, warmed up, on the first
  ``--hf-batch`` requests (its expert loop makes the whole batch take too long).
* ``kernel``: the ``moe`` op's implementations at batch 512 on the same layer shape (hidden 2048, experts of
  768 columns, top-8 of 128): weft-triton's fused kernel and core's torch reference (torch's grouped GEMM),
  each as a fraction of the measured bf16 matmul rate over the FLOPs of the (token, expert) pairs computed;
  and the fused kernel at batch 1, 16, 64 and 256 against the bytes of the experts it must read.

Usage (H100 or H200, about 10 minutes): python bench/moe.py --tokenizer DIR [--part engine] [--part kernel]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (  # noqa: E402
    MemoryLoader,
    copy_bandwidth,
    cuda_time,
    hf_config,
    hf_generate,
    matmul_rate,
    registry_with_memory_loader,  # noqa: E402
)

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)


def parameter_counts(shape: dict) -> dict[str, int]:
    """Parameters per token kind: attention and router per layer, one expert, the LM head."""
    hidden, heads, dim = shape["hidden_size"], shape["num_attention_heads"], shape["head_dim"]
    kv_heads = shape["num_key_value_heads"]
    return {
        "attention": hidden * (heads + 2 * kv_heads) * dim + heads * dim * hidden,
        "router": hidden * shape["num_experts"],
        "expert": 3 * hidden * shape["moe_intermediate_size"],
        "head": shape["vocab_size"] * hidden,
    }


def touched_experts(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts a layer's ``tokens`` tokens touch, each picking ``top_k`` of ``experts`` uniformly."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def physical_bound(shape: dict, requests: int, prompt: int, output: int, bandwidth: float, flops: float) -> float:
    counts, layers = parameter_counts(shape), shape["num_hidden_layers"]
    experts, top_k = shape["num_experts"], shape["num_experts_per_tok"]
    active = layers * (counts["attention"] + counts["router"] + top_k * counts["expert"]) + counts["head"]
    kv_per_token = 2 * 2 * layers * shape["num_key_value_heads"] * shape["head_dim"]
    seconds = 2 * active * requests * prompt / flops
    for step in range(1, output):
        weights = 2 * (
            layers
            * (counts["attention"] + counts["router"] + touched_experts(requests, experts, top_k) * counts["expert"])
            + counts["head"]
        )
        hbm = (weights + requests * kv_per_token * (prompt + step)) / bandwidth
        seconds += max(hbm, 2 * active * requests / flops)
    return seconds


def random_weight(name: str, shape: torch.Size) -> torch.Tensor:
    """The bf16 weight ``name`` on the GPU: ones for a norm, else N(0, 0.02) seeded by the name (the same tensor
    each time it is made, so transformers and the engine run the same weights without holding two copies)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)


def part_engine(args: argparse.Namespace, bandwidth: float, flops: float) -> None:
    from transformers import AutoModelForCausalLM

    from weft import LLM, SamplingParams

    shape, requests, prompt, output = QWEN3_30B_A3B, 256, 512, 256
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, shape["vocab_size"] - 10, (requests, prompt), generator=generator)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16).eval()
    with torch.no_grad():  # N(0, 0.02) everywhere, as the other benchmarks' random weights
        for name, parameter in hf.named_parameters():
            parameter.copy_(random_weight(name, parameter.shape))
    hf_generate(hf, prompts[:4].cuda(), 8)  # warm
    hf_batch = args.hf_batch
    hf_seconds = hf_generate(hf, prompts[-hf_batch:].cuda(), output)
    hf_rate = hf_batch * output / hf_seconds
    print(
        f"qwen3-30b-a3b: HF transformers generate() {hf_rate:,.0f} output tokens/s (batch {hf_batch}, warm, "
        f"experts '{getattr(hf.config, '_experts_implementation', 'eager')}')",
        flush=True,
    )
    shapes = {name: tensor.shape for name, tensor in hf.state_dict().items()}
    del hf  # the engine gets the same weights made again, one tensor at a time: one copy of the 61 GB on the GPU
    gc.collect()
    torch.cuda.empty_cache()

    def weights():
        for name, tensor_shape in shapes.items():
            yield name, random_weight(name, tensor_shape)

    model = MemoryLoader.add("qwen3-30b-a3b", shape, weights, args.tokenizer)
    llm = LLM(
        model=model, registry=registry_with_memory_loader(), use={"platform": "cuda"}, engine={"dtype": "bfloat16"}
    )
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([row[::-1] for row in prompts[:8].tolist()], warm)  # reversed: the timed prompts find no prefix
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts.tolist(), params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == requests * output
    rate = requests * output / seconds
    bound = physical_bound(shape, requests, prompt, output, bandwidth, flops)
    print(
        f"qwen3-30b-a3b {requests} x ({prompt}, {output}): Weft {rate:,.0f} output tokens/s ({seconds:.1f} s)",
        flush=True,
    )
    print(
        f"  physical bound {bound:.1f} s ({requests * output / bound:,.0f} tokens/s): Weft at {bound / seconds:.0%} "
        f"of it (goal 60%)",
        flush=True,
    )
    print(f"  HF generate() {hf_rate:,.0f} tokens/s: Weft = {rate / hf_rate:.1f}x HF", flush=True)
    llm.close()


def part_kernel(flops: float, bandwidth: float) -> None:
    from weft.builtins.moe import MoETorch
    from weft.kernels.warmup import compile_many
    from weft.layers.moe import MoERouting
    from weft.plugins import PluginRegistry
    from weft_triton.ops import MoETriton

    shape = QWEN3_30B_A3B
    hidden, experts, top_k = shape["hidden_size"], shape["num_experts"], shape["num_experts_per_tok"]
    inter = shape["moe_intermediate_size"]
    platform = PluginRegistry().load("platform", "cuda")()
    fused, reference = MoETriton(platform), MoETorch(platform)
    fused.declare(
        num_experts=experts,
        top_k=top_k,
        hidden_size=hidden,
        intermediate_size=inter,
        dtype=torch.bfloat16,
        activation=None,
        bias=False,
    )
    compile_many(fused.kernel, fused.kernel.warmup_keys())
    generator = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator).bfloat16() * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=generator).bfloat16() * 0.02
    routing = MoERouting(top_k=top_k)
    for batch in (512, 256, 64, 16, 1):
        x = torch.randn(batch, hidden, device="cuda", generator=generator).bfloat16()
        logits = torch.randn(batch, experts, device="cuda", generator=generator)
        torch.testing.assert_close(
            fused(x, logits, w13, w2, routing), reference(x, logits, w13, w2, routing), rtol=3e-2, atol=3e-2
        )
        fused_seconds = cuda_time(lambda x=x, logits=logits: fused(x, logits, w13, w2, routing), repeats=20)
        reference_seconds = cuda_time(lambda x=x, logits=logits: reference(x, logits, w13, w2, routing), repeats=20)
        fused_graph = graph_time(lambda x=x, logits=logits: fused(x, logits, w13, w2, routing))
        reference_graph = graph_time(lambda x=x, logits=logits: reference(x, logits, w13, w2, routing))
        pair_flops = 2 * batch * top_k * 3 * hidden * inter
        touched = touched_experts(batch, experts, top_k)
        weight_seconds = 2 * 3 * hidden * inter * touched / bandwidth
        print(
            f"moe op batch {batch}: fused Triton {fused_seconds * 1e6:,.0f} us = "
            f"{pair_flops / fused_seconds / 1e12:.0f} TFLOP/s, {pair_flops / fused_seconds / flops:.0%} of the bf16 "
            f"matmul rate{' (goal 60%)' if batch == 512 else ''}; torch reference {reference_seconds * 1e6:,.0f} us = "
            f"{pair_flops / reference_seconds / flops:.0%}; fused = {reference_seconds / fused_seconds:.2f}x the "
            f"reference; reading the {touched:.0f} touched experts at the copy bandwidth takes "
            f"{weight_seconds * 1e6:,.0f} us = {weight_seconds / fused_seconds:.0%} of the fused time",
            flush=True,
        )
        print(
            f"  in a CUDA graph (no launch overhead, as decode runs): fused {_us(fused_graph)}"
            + (
                f" = {pair_flops / fused_graph / flops:.0%} of the matmul rate, reading the experts at the copy "
                f"bandwidth = {weight_seconds / fused_graph:.0%} of it"
                if fused_graph
                else ""
            )
            + f"; torch reference {_us(reference_graph)}",
            flush=True,
        )


def graph_time(run, launches: int = 10) -> float | None:
    """Median seconds of ``run()`` over 5 replays of a CUDA graph of ``launches`` calls (the GPU's time alone);
    None where ``run`` cannot be captured (a host synchronisation)."""
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                run()
    except RuntimeError as error:
        print(f"  (not capturable: {str(error).splitlines()[0]})", flush=True)
        torch.cuda.synchronize()
        return None
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    del graph
    return sorted(times)[2]


def _us(seconds: float | None) -> str:
    return "not capturable" if seconds is None else f"{seconds * 1e6:,.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer folder (SmolLM2's will do: ids are random)")
    parser.add_argument("--part", action="append", choices=["engine", "kernel"])
    parser.add_argument("--hf-batch", type=int, default=64)
    args = parser.parse_args()
    parts = args.part or ["kernel", "engine"]
    bandwidth, flops = copy_bandwidth(), matmul_rate()
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} "
        f"TFLOP/s (8192^3, cuBLAS)",
        flush=True,
    )
    if "kernel" in parts:
        part_kernel(flops, bandwidth)
    if "engine" in parts:
        if args.tokenizer is None:
            parser.error("--part engine needs --tokenizer")
        part_engine(args, bandwidth, flops)


if __name__ == "__main__":
    main()
