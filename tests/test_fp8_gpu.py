"""fp8 on an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper): weft-cuda's ``fp8`` method through the
quantization contract, its one-row GEMV path, and an engine with fp8 weights and an fp8 KV cache against the
same engine in bf16. The fp8 KV cache's kernels go through the attention contract in
tests/test_triton_attention.py (``TestTritonAttentionOnGPU``, whose steps run again over a float8 cache)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from weft.testing import QuantizationContract


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_fp8_gpu(), reason="needs a GPU of compute capability 8.9+")]


class TestFp8OnGPU(QuantizationContract):
    plugin_name = "fp8"
    platform = "cuda"


def test_one_row_goes_through_the_gemv_and_matches_the_dequantized_product():
    from weft.kernels.warmup import collecting
    from weft_cuda.fp8 import Fp8
    from weft_cuda.platform import CudaPlatform

    with collecting() as kernels:
        method = Fp8(CudaPlatform(), "bfloat16")
        layer = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
        layer.weight = torch.nn.Parameter(torch.empty(0, device="cuda"), requires_grad=False)
        method.create_weights(layer, 4096, 1024)
    weight = torch.randn(1024, 4096, device="cuda") * 0.02
    method.load_weight(layer, weight, 0, "w")
    method.process_weights_after_loading(layer)
    kernels.warm_up()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    expected = x.float() @ (layer.fp8_codes.float() * layer.fp8_scales[:, None]).t()
    actual = method.apply(layer, x, None)
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    assert method.gemv.compiled and method.gemv.monitor.misses == []


def _transformers_log_probs(folder, sequence: list[int]) -> dict[str, torch.Tensor]:
    """Teacher-forced log-probabilities of ``sequence`` by transformers in bf16 on the GPU, and with every projection's
    weights and inputs rounded to fp8 as weft-cuda rounds them (per output channel, per token): the fp8 format's own
    error on this model, against which the engine's is judged."""
    from transformers import AutoModelForCausalLM

    from weft_cuda.fp8 import emulate_in_plain_torch

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([sequence], device="cuda")

    def log_probs() -> torch.Tensor:
        with torch.inference_mode():
            logits = model(ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].cpu()

    result = {"bf16": log_probs()}
    emulate_in_plain_torch(model)
    result["fp8"] = log_probs()
    return result


def test_engine_with_fp8_weights_and_cache_stays_near_bf16(tmp_path, tokenizer_files):
    """A tiny Llama (dims multiples of 16) in bf16, with fp8 weights, and with fp8 weights and cache: the teacher-forced
    log-probabilities of the bf16 engine's greedy continuation stay within the fp8 format's own error of bf16's
    (transformers with fp8-rounded projections against transformers in bf16, on the same weights: 0.54 nats on this
    model, whose N(0, 0.2) weights spread its logits wide), and the fp8 cache holds twice the tokens of the bf16 one
    in the same bytes."""
    from weft import LLM, SamplingParams

    folder = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files, hidden_size=128, intermediate_size=256)
    prompt = [1, 523, 1020, 77, 9, 4000, 12, 300]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    results = {}
    configs = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    for name, options in configs.items():
        # runtime_jit = "error": warm-up compiled every fp8 kernel (GEMV, row quantization, fp8 cache store and read).
        llm = LLM(model=str(folder), dtype="bfloat16", gpu_memory_utilization=0.3, runtime_jit="error", **options)
        try:
            if name == "bf16":
                sequence = prompt + list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            scored = llm.generate(
                [sequence], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False
            )[0].prompt_logprobs[1:]
            caches = llm.engine.worker.kv_caches.values()
            results[name] = (
                torch.tensor([position[token].logprob for position, token in zip(scored, sequence[1:], strict=True)]),
                llm.engine.core.startup["kv_capacity_tokens"] / sum(c.numel() * c.element_size() for c in caches),
                llm.engine.worker.quantization_name,
                next(iter(caches)).dtype,
            )
        finally:
            llm.close()
    reference = _transformers_log_probs(folder, sequence)
    floor = (reference["bf16"] - results["bf16"][0]).abs().mean().item()  # two bf16 implementations
    own = (reference["fp8"] - reference["bf16"]).abs().mean().item()
    assert results["fp8"][2] == "fp8" and results["fp8+kv"][3] == torch.float8_e4m3fn
    assert results["fp8+kv"][1] == pytest.approx(2 * results["bf16"][1], rel=0.01)
    assert (results["fp8"][0] - results["bf16"][0]).abs().mean() <= 1.25 * own + floor
    # The cache rounds K and V as the projections round their inputs (2^-4 relative at worst): at most as much again.
    assert (results["fp8+kv"][0] - results["bf16"][0]).abs().mean() <= 2 * own + floor
