"""The CPU's GEMM instruction sets: /proc/cpuinfo parsed, the GEMM dtype chosen from them and printed, and
cpu_int4's multi-row GEMMs in that dtype against float32 on the dequantized weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from weft.runner import cpu_isa
from weft.runner.cpu_isa import CpuIsa, describe, gemm_dtype, parse_cpuinfo

# Abridged /proc/cpuinfo of four hosts (the first processor's lines; the flags as the kernel lists them).
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 ssse3 fma avx avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 \
avx_vnni amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2 fma avx f16c avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni
"""
SKYLAKE_CLIENT = """processor\t: 0
model name\t: Intel(R) Core(TM) i7-6700 CPU @ 3.40GHz
flags\t\t: fpu sse sse2 ssse3 fma avx f16c avx2 bmi2
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes sha1 sha2 crc32 atomics fphp asimdhp sve bf16 i8mm
CPU implementer\t: 0x41
"""


def isa(text: str) -> CpuIsa:
    model, flags = parse_cpuinfo(text)
    return CpuIsa(model, flags, "AVX512")


def test_cpuinfo_samples_parse_to_their_model_flags_and_gemm_dtype():
    amx, zen4, avx2, arm = isa(SAPPHIRE_RAPIDS), isa(ZEN4), isa(SKYLAKE_CLIENT), isa(GRAVITON3)
    assert amx.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert amx.gemm_flags == [
        "amx_bf16",
        "amx_int8",
        "avx512_bf16",
        "avx512_fp16",
        "avx512_vnni",
        "avx_vnni",
        "avx512f",
        "avx2",
        "fma",
    ]
    assert "fpu" in amx.flags and len(amx.flags) > 3  # the first processor's flags, not the second's
    assert (gemm_dtype(amx), amx.int8_dot) == ("bfloat16", True)
    assert zen4.model == "AMD EPYC 9654 96-Core Processor"
    assert zen4.gemm_flags == ["avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma"]
    assert (gemm_dtype(zen4), zen4.int8_dot) == ("bfloat16", True)
    assert avx2.gemm_flags == ["avx2", "fma"]
    assert (gemm_dtype(avx2), avx2.int8_dot) == ("float32", False)
    # Arm names its features differently (bf16, i8mm) and has no model name line: none of the x86 GEMM flags.
    assert (arm.model, arm.gemm_flags, gemm_dtype(arm)) == ("unknown", [], "float32")
    assert "sve" in arm.flags
    assert parse_cpuinfo("") == ("unknown", frozenset())


def test_describe_names_the_flags_and_the_choice():
    assert describe(isa(ZEN4)) == (
        "AMD EPYC 9654 96-Core Processor: avx512_bf16 avx512_vnni avx512f avx2 fma (torch kernels: AVX512); "
        "batch GEMMs in bfloat16 (native bf16 dot products)"
    )
    assert describe(isa(SKYLAKE_CLIENT)).endswith(
        "avx2 fma (torch kernels: AVX512); batch GEMMs in float32 (no native bf16 (AMX or AVX-512 BF16))"
    )


def test_this_host_is_detected_from_proc_cpuinfo_and_torch():
    host = cpu_isa.detect()
    assert host.torch_capability == torch.backends.cpu.get_cpu_capability()
    with open("/proc/cpuinfo") as cpuinfo:
        assert host.flags == parse_cpuinfo(cpuinfo.read())[1]


def test_config_show_prints_the_cpu_line():
    shown = subprocess.run(
        [sys.executable, "-m", "weft.cli", "config", "show", "--set", "use.platform=cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"# CPU: {describe(cpu_isa.detect())}" in shown.stdout.splitlines(), shown.stdout


def int4_layer(method, weight):
    from torch import nn

    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=False)
    layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    method.create_weights(layer, in_features, out_features)
    method.load_weight(layer, weight, 0, "test.weight")
    method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("host", [ZEN4, SKYLAKE_CLIENT], ids=["bf16-native", "avx2-only"])
def test_cpu_int4_multi_row_gemms_in_the_chosen_dtype(host, monkeypatch):
    """Against float32 on the dequantized weights (scales exact in bf16, so the only roundings left are the
    chosen dtype's): a bf16-native host's kernel keeps its inputs exact (hi + lo) and rounds only its outputs;
    an AVX2 host multiplies GEMMs of more than DECODE_ROWS rows in float32 (1e-5)."""
    from weft.builtins import cpu_quantization
    from weft.builtins.cpu import CpuPlatform
    from weft.contracts.quantization import GroupAffine

    monkeypatch.setattr(cpu_quantization, "detect", lambda: isa(host))
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 256), generator=generator, dtype=torch.uint8)
    scales = 2.0 ** torch.randint(-8, -4, (64, 8), generator=generator).float()
    offsets = -8 * scales
    weight = GroupAffine(codes, scales, offsets, 32, 4, False, "Q4_0")
    layer = int4_layer(cpu_quantization.CpuInt4(CpuPlatform(), "float32"), weight)
    assert layer.gemm_dtype == gemm_dtype(isa(host))
    for rows in (1, cpu_quantization.DECODE_ROWS + 32):
        x = torch.randn(rows, 256, generator=generator)
        expected = x.double() @ weight.dequantize().double().t()
        actual = cpu_quantization.CpuInt4(CpuPlatform(), "float32").apply(layer, x, None)
        error = (actual.double() - expected).abs()
        if rows > cpu_quantization.DECODE_ROWS and gemm_dtype(isa(host)) == "float32":
            assert error.max() <= 1e-5 * expected.abs().max(), error.max()
        else:
            # The kernel rounds only its outputs to bf16 (2^-9 of hi @ W, itself within 2^-9 of sum |x w| of the
            # output); inputs rounded to bf16 would add errors of up to 2^-9 of sum |x w|, far over 2^-14.
            magnitude = x.abs().double() @ weight.dequantize().abs().double().t()
            assert (error <= 2.0**-8 * expected.abs() + 2.0**-14 * magnitude).all()
