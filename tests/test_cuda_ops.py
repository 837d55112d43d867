"""weft-triton's skinny-matrix linear kernel: equal to F.linear, under the interpreter on the CPU and on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from weft.kernels.warmup import compile_many  # noqa: E402
from weft.testing import OpContract  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("rows", [1])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_kernel_matches_linear_interpreted(rows, bias):
    from weft_triton.gemv import GemvKernel

    generator = torch.Generator().manual_seed(rows)
    n, k = 40, 600  # neither a multiple of the tiles: masked edges in both directions
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    b = torch.randn(n, generator=generator) if bias else None
    kernel = GemvKernel()
    kernel.add_shape(n, k, bias, torch.float32)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1  # the one-row tile
    y = kernel(dtype=x.dtype, n=n, k=k, m=rows, has_bias=bias, x=x, weight=weight, bias=b)
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert kernel.monitor.misses == []


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemv_kernel_matches_the_dequantized_product_interpreted(bias):
    """float8_e4m3fn weights with a scale per output column: ``x @ (codes * scale)^T + b`` in float32."""
    from weft_triton.gemv import Fp8GemvKernel

    generator = torch.Generator().manual_seed(3)
    n, k = 40, 600
    x = torch.randn(1, k, generator=generator)
    codes = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=generator) / 1000 + 1e-4
    b = torch.randn(n, generator=generator) if bias else None
    kernel = Fp8GemvKernel()
    kernel.add_shape(n, k, bias, torch.float32)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1
    y = kernel(dtype=x.dtype, n=n, k=k, m=1, has_bias=bias, x=x, weight=codes, scale=scale, bias=b)
    torch.testing.assert_close(y, F.linear(x, codes.float() * scale[:, None], b), rtol=1e-5, atol=1e-5)
    assert kernel.monitor.misses == []


def _fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 quantization in plain torch: ``scale = max |row| / 448`` (``1 / 448`` for zeros), the codes
    ``x / scale`` clamped to +-448 and cast (round to nearest-even)."""
    largest = x.float().abs().amax(dim=1)
    # Divided by a tensor: CUDA divides by a Python float as a multiplication by its reciprocal (a last-bit miss).
    scales = torch.where(largest > 0, largest, torch.ones_like(largest)) / torch.full_like(largest, 448.0)
    return (x.float() / scales[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scales


def _check_fp8_rows_kernel(device: str, dtype: torch.dtype) -> None:
    from weft_triton.quantize import Fp8QuantizeRowsKernel

    generator = torch.Generator().manual_seed(5)
    k = 1500  # two row tiles, the second masked
    x = torch.randn(6, k, generator=generator) * torch.logspace(-4, 3, 6)[:, None]
    x[2] = 0.0  # a row of zeros: scale 1 / 448, codes 0
    x[4, :8] = torch.tensor([448.0, -448.0, 0.486, -0.486, 1e-6, 3.0, 0.0, -2.75]) * x[4].abs().max() / 448
    x = x.to(device, dtype)
    kernel = Fp8QuantizeRowsKernel()
    kernel.add_shape(k, dtype)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1
    codes, scales = kernel(dtype=dtype, k=k, x=x)
    expected_codes, expected_scales = _fp8_rows_reference(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert kernel.monitor.misses == []


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_row_quantization_kernel_equals_plain_torch_interpreted(dtype):
    """Codes and scales bit for bit equal to plain torch's per-row quantization, zeros and saturation included."""
    _check_fp8_rows_kernel("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs a GPU with fp8"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_row_quantization_kernel_equals_plain_torch_on_gpu(dtype):
    _check_fp8_rows_kernel("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestLinearTritonOnGPU(OpContract):
    plugin_name = "linear.triton"
    device = "cuda"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
@pytest.mark.parametrize("op", ["rms_norm", "rotary", "qk_norm_rotary", "silu_and_mul"])
def test_fused_kernels_match_their_references_interpreted(op):
    """The kernels themselves (float32 on the CPU), on every example input of the op's reference."""
    from weft.builtins import ops as references
    from weft_triton import fused

    reference = {
        "rms_norm": references.RmsNormTorch,
        "rotary": references.RotaryTorch,
        "qk_norm_rotary": references.QkNormRotaryTorch,
        "silu_and_mul": references.SiluAndMulTorch,
    }[op](None)
    kernel = {
        "rms_norm": fused.RmsNormKernel,
        "rotary": fused.RotaryKernel,
        "qk_norm_rotary": fused.QkNormRotaryKernel,
        "silu_and_mul": fused.SiluAndMulKernel,
    }[op]()
    checked = 0
    for args, kwargs in type(reference).example_inputs("cpu"):
        if args[0].dtype != torch.float32:
            continue  # the interpreter computes in numpy, which has no bfloat16
        if op == "rms_norm":
            x, weight, eps = args
            residual = kwargs.get("residual")
            got = kernel(
                dtype=x.dtype,
                shape=(x.shape[-1],),
                flag=residual is not None,
                x=x,
                weight=weight,
                eps=eps,
                residual=residual,
            )
        elif op == "rotary":
            query, key, cos, sin = args
            got = kernel(
                dtype=query.dtype,
                shape=(query.shape[1], key.shape[1], query.shape[2]),
                query=query,
                key=key,
                cos=cos,
                sin=sin,
            )
        elif op == "qk_norm_rotary":
            query, key, query_weight, key_weight, eps, cos, sin = args
            got = kernel(
                dtype=query.dtype,
                shape=(query.shape[1], key.shape[1], query.shape[2]),
                query=query,
                key=key,
                query_weight=query_weight,
                key_weight=key_weight,
                eps=eps,
                cos=cos,
                sin=sin,
            )
        else:
            (x,) = args
            got = kernel(dtype=x.dtype, shape=(x.shape[-1] // 2,), x=x)
        expected = reference(*args, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked >= 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestRmsNormTritonOnGPU(OpContract):
    plugin_name = "rms_norm.triton"
    device = "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestRotaryTritonOnGPU(OpContract):
    plugin_name = "rotary.triton"
    device = "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestQkNormRotaryTritonOnGPU(OpContract):
    plugin_name = "qk_norm_rotary.triton"
    device = "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestSiluAndMulTritonOnGPU(OpContract):
    plugin_name = "silu_and_mul.triton"
    device = "cuda"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
def test_bitmask_argmax_kernel_matches_its_reference_interpreted():
    """Ties, a row allowing only its last token, one allowing nothing, NaN and +inf masked and not, vocabularies
    that are no multiple of the block or of 32, rows without a mask: tokens and health equal to the reference."""
    from weft.builtins.bitmask_argmax import BitmaskArgmaxTorch
    from weft_triton.bitmask_argmax import BitmaskArgmaxKernel

    reference = BitmaskArgmaxTorch(None)
    kernel = BitmaskArgmaxKernel()
    kernel.add(torch.float32)
    assert len(compile_many(kernel, kernel.warmup_keys())) == 1
    checked = 0
    for (logits, mask_rows, bitmask), _ in BitmaskArgmaxTorch.example_inputs("cpu"):
        if logits.dtype != torch.float32:
            continue  # the interpreter computes in numpy, which has no bfloat16
        untouched = logits.clone()
        tokens, healthy = kernel(dtype=logits.dtype, logits=logits, mask_rows=mask_rows, bitmask=bitmask)
        torch.testing.assert_close(logits, untouched, rtol=0, atol=0, equal_nan=True)  # the kernel writes no logit
        expected_tokens, expected_healthy = reference(untouched.clone(), mask_rows, bitmask)
        assert torch.equal(healthy, expected_healthy)
        assert torch.equal(tokens, expected_tokens)
        checked += 1
    assert checked == 5 and not bool(expected_healthy.all()) and kernel.monitor.misses == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
class TestBitmaskArgmaxTritonOnGPU(OpContract):
    """The kernel on the GPU against the reference on every example input, bf16 included."""

    plugin_name = "bitmask_argmax.triton"
    device = "cuda"
