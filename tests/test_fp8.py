"""fp8 on the CPU: what can be checked without fp8 tensor cores.

* ``engine.quantization = "fp8"`` and ``engine.kv_cache_dtype = "fp8"`` are refused on the CPU with the option,
  the value, what they need and the fix.
* weft-cuda's fp8 math (per-row quantization, the per-token ``torch._scaled_mm`` product) against transformers'
  own fp8 quantizer and plain torch, and through the quantization contract's check on the CPU (torch converts
  float8 and has a CPU ``_scaled_mm``).
* fp8 checkpoints (compressed-tensors float-quantized, per channel and per tensor; FBGEMM's ``fbgemm_fp8``) read
  by the safetensors loader: codes and scales exactly as stored, and greedy output equal to transformers on the
  dequantized weights.

The fp8 KV cache's kernels are checked by the attention contract (tests/test_builtin_contracts.py, and
tests/test_triton_attention.py under ``TRITON_INTERPRET=1``); the GPU side is tests/test_fp8_gpu.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import make_tiny_model
from test_hf_parity import hf_greedy

pytest.importorskip("weft_cuda")


def start_error(tmp_path, tokenizer_files, **options) -> str:
    from weft import LLM

    model = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the engine may wrap the worker's ValueError
        LLM(model=str(model), **options)
    return str(raised.value)


def test_fp8_weights_are_refused_on_the_cpu(tmp_path, tokenizer_files):
    message = start_error(tmp_path, tokenizer_files, quantization="fp8")
    assert "engine.quantization = 'fp8' needs a CUDA GPU with compute capability >= 8.9" in message
    assert "this platform is cpu" in message
    assert "'none'" in message and "'cpu_int4'" in message  # the fix: what runs here


def test_fp8_kv_cache_is_refused_on_the_cpu(tmp_path, tokenizer_files):
    message = start_error(tmp_path, tokenizer_files, kv_cache_dtype="fp8")
    assert "engine.kv_cache_dtype = 'fp8' needs a CUDA GPU with compute capability >= 8.9" in message
    assert "this platform is cpu" in message and "engine.kv_cache_dtype = 'auto'" in message


@pytest.mark.parametrize("distribution", ["weft_rocm", "weft_xpu"])
def test_fp8_is_refused_on_the_other_gpu_platforms(distribution):
    """ROCm and XPU inherit the platform contract's default (no fp8): both options are refused with the requirement
    and the platform's name, before any weight is read."""
    from weft.config import WeftConfig
    from weft.config.schema import EngineConfig
    from weft.plugins import PluginRegistry
    from weft.resolve import check_kv_cache_dtype, choose_quantization

    module = pytest.importorskip(f"{distribution}.platform")
    platform_class = next(
        value
        for name, value in vars(module).items()
        if name.endswith("Platform") and value.__module__ == module.__name__
    )
    platform = platform_class()
    assert platform.name == distribution.removeprefix("weft_")
    fp8_weights = WeftConfig(engine=EngineConfig(quantization="fp8"))
    with pytest.raises(ValueError, match="engine.quantization = 'fp8' needs a CUDA GPU with compute capability >= 8.9"):
        choose_quantization(PluginRegistry(), fp8_weights, platform, "safetensors", "bfloat16")
    with pytest.raises(ValueError, match=f"this platform is {platform.name}; use engine.kv_cache_dtype = 'auto'"):
        check_kv_cache_dtype(WeftConfig(engine=EngineConfig(kv_cache_dtype="fp8")), platform, None)


def test_fp8_kv_cache_doubles_the_tokens_a_block_budget_holds():
    """The cache is sized from the specs: an fp8 block of the same tokens takes half of bf16's bytes."""
    from weft.config import WeftConfig
    from weft.config.schema import EngineConfig
    from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
    from weft.resolve import with_kv_cache_dtype

    spec = FullAttentionSpec(block_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128)
    groups = (KVCacheGroupSpec("attention", ("layer.0",), spec),)
    fp8 = with_kv_cache_dtype(WeftConfig(engine=EngineConfig(kv_cache_dtype="fp8")), groups)
    assert fp8[0].spec.dtype == "float8_e4m3fn"
    assert spec.page_size_bytes() == 2 * fp8[0].spec.page_size_bytes() == 2 * 2 * 16 * 8 * 128


def test_rows_quantize_as_transformers_quantizes_them():
    """Codes bit for bit and scales equal to transformers' fp8 per-row quantizer (compressed-tensors' FP8 layer)."""
    from transformers.integrations.compressed_tensors import quantize_fp8_per_row

    from weft_cuda.fp8 import quantize_rows

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=generator) * torch.logspace(-3, 1, 48).unsqueeze(1)
    weight[5] = 0  # an all-zero row
    codes, scales = quantize_rows(weight)
    expected_codes, expected_scales = quantize_fp8_per_row(weight)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    torch.testing.assert_close(scales, expected_scales, rtol=0, atol=0)
    # Each weight within half a float8 step of itself: 2^-4 relative above the normal range's floor.
    error = (codes.float() * scales[:, None] - weight).abs()
    assert (error <= weight.abs() * 2**-4 + scales[:, None] * 2**-10).all()


def test_scaled_matmul_equals_the_product_of_the_rounded_operands():
    """``torch._scaled_mm`` with per-token and per-channel scales against plain float32 on the rounded operands."""
    from weft_cuda.fp8 import quantize_rows, scaled_matmul

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(7, 128, generator=generator)
    weight = torch.randn(64, 128, generator=generator) * 0.05
    codes, scales = quantize_rows(weight)
    x_codes, x_scales = quantize_rows(x)
    expected = (x_codes.float() * x_scales[:, None]) @ (codes.float() * scales[:, None]).t()
    actual = scaled_matmul(x, codes, scales)
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_the_method_passes_the_contract_check_on_the_cpu():
    """The quantization contract's check (every weight format, two row blocks, float32 and bf16 activations) on
    the CPU's ``_scaled_mm``; on the GPU the kit runs it as such (tests/test_fp8_gpu.py)."""
    from weft.builtins.cpu import CpuPlatform
    from weft.testing.quantization_suite import QuantizationContract, check_apply
    from weft_cuda.fp8 import Fp8

    check_apply(Fp8, CpuPlatform(), ("float32", "bfloat16"), QuantizationContract.rounded_float_tolerance)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(folder, checkpoint_format: str, per_tensor: bool = False) -> dict[str, torch.Tensor]:
    """Rewrite the float checkpoint in ``folder`` as an fp8 one of ``checkpoint_format``; returns the dequantized
    weights (``codes * scale``) by name, the reference's."""
    from safetensors.torch import load_file, save_file

    from weft_cuda.fp8 import quantize_rows

    tensors = load_file(str(folder / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if not any(f".{linear}.weight" in name for linear in LINEARS):
            stored[name] = tensor
            continue
        if per_tensor:
            scale = tensor.abs().max().reshape(1) / 448
            codes = (tensor / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            codes, scale = quantize_rows(tensor)
            scale = scale[:, None]
        stored[name], stored[name + "_scale"] = codes, scale.float()
        prefix = name.removesuffix(".weight")
        if checkpoint_format == "fbgemm_fp8":
            stored[prefix + ".input_scale_ub"] = torch.tensor([1200.0])
        else:
            stored[prefix + ".input_scale"] = torch.tensor([0.05])
        dequantized[name] = codes.float() * scale
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    if checkpoint_format == "fbgemm_fp8":
        config["quantization_config"] = {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": ["lm_head"],
        }
    else:
        strategy = "tensor" if per_tensor else "channel"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                }
            },
            "ignore": ["lm_head"],
        }
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize(
    "checkpoint_format, per_tensor",
    [("compressed-tensors", False), ("compressed-tensors", True), ("fbgemm_fp8", False)],
)
def test_fp8_checkpoints_load_as_their_dequantized_weights(tmp_path, tokenizer_files, checkpoint_format, per_tensor):
    """The loader pairs each fp8 weight with its scale (codes kept exactly for a method), and an engine on dense
    weights (``quantization = "none"``, the CPU's) generates what transformers does on ``codes * scale``."""
    from transformers import AutoModelForCausalLM

    from weft import LLM, SamplingParams
    from weft.builtins.safetensors_loader import Fp8Weight, SafetensorsLoader

    folder = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)
    reference_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    dequantized = write_fp8_checkpoint(folder, checkpoint_format, per_tensor)

    loader = SafetensorsLoader()
    source = loader.resolve(str(folder))
    seen = dict(loader.iter_weight_slices(source, "float32"))
    assert not any(name.endswith(("_scale", "_scale_ub")) for name in seen)
    for name, expected in dequantized.items():
        weight = seen[name]
        assert isinstance(weight, Fp8Weight), name
        affine = weight.group_affine()
        assert affine.float_codes and affine.scales.shape == (expected.shape[0], 1)
        assert torch.equal(affine.dequantize(), expected)
        assert torch.equal(weight.narrow(0, 3, 5), expected[3:8])

    with torch.no_grad():
        for name, parameter in reference_model.named_parameters():
            if name in dequantized:
                parameter.copy_(dequantized[name])
    prompts = [[1, 523, 1020, 77, 9], [1, 44, 3000]]
    expected_tokens = hf_greedy(reference_model, prompts, new_tokens=8)
    llm = LLM(model=str(folder), dtype="float32", quantization="none")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    assert [output.outputs[0].token_ids for output in outputs] == expected_tokens


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_many_rows_are_quantized_by_the_triton_kernel_interpreted(monkeypatch):
    """Where Triton runs, the method quantizes a many-row step's activations in one kernel launch (torch's
    ``quantize_rows`` is not called) and the product is the one of torch's codes and scales."""
    from weft.builtins.cpu import CpuPlatform
    from weft.kernels.warmup import compile_many
    from weft_cuda import fp8
    from weft_triton.quantize import Fp8QuantizeRowsKernel

    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 1104, generator=generator) * 0.05
    x = torch.randn(5, 1104, generator=generator)
    expected = fp8.scaled_matmul(x, *fp8.quantize_rows(weight))
    method = fp8.Fp8(CpuPlatform(), "float32")
    method.quantize = Fp8QuantizeRowsKernel()
    layer = torch.nn.Linear(1104, 64, bias=False)
    method.create_weights(layer, 1104, 64)
    method.load_weight(layer, weight, 0, "weight")
    method.process_weights_after_loading(layer)
    assert len(compile_many(method.quantize, method.quantize.warmup_keys())) == 1
    monkeypatch.setattr(fp8, "quantize_rows", None)  # the weights are quantized: only activations remain
    actual = method.apply(layer, x, None)
    assert torch.equal(actual, expected.float())
    assert method.quantize.monitor.misses == []
