"""Which instruction sets the host CPU has for matrix multiplies, and the GEMM dtype chosen from them.

Read once per process from torch (``torch.backends.cpu.get_cpu_capability()``: the widest vector
ISA its own kernels dispatch to, ``AVX512``, ``AVX2``, ``DEFAULT``...) and from the kernel's view of
the CPU (``/proc/cpuinfo``'s ``flags``, what oneDNN dispatches on): AMX tiles (``amx_bf16``,
``amx_int8``), bf16 dot products (``avx512_bf16``, ``avx_ne_convert``...), int8 dot products
(``avx512_vnni``, ``avx_vnni``), AVX-512 and AVX2.

:func:`gemm_dtype` is what multi-row GEMMs (batch decode, prefill) multiply in: ``bfloat16`` where
the CPU multiplies it natively (AMX or AVX-512 BF16: twice float32's rate per instruction or more),
``float32`` elsewhere (bf16 there is converted to float32 in software first, no faster than float32).
The startup summary and ``weft config show`` print :func:`describe`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# The flags that matter to GEMMs, in the order they are printed (the best first).
GEMM_FLAGS = (
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "avx512f",
    "avx2",
    "fma",
)
BF16_NATIVE = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuIsa:
    """The CPU's model name, its GEMM-relevant flags and torch's dispatch capability."""

    model: str
    flags: frozenset[str]
    torch_capability: str

    @property
    def gemm_flags(self) -> list[str]:
        return [flag for flag in GEMM_FLAGS if flag in self.flags]

    @property
    def bf16_native(self) -> bool:
        return any(flag in self.flags for flag in BF16_NATIVE)

    @property
    def int8_dot(self) -> bool:
        return any(flag in self.flags for flag in ("amx_int8", "avx512_vnni", "avx_vnni"))


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first processor in ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``);
    ``("unknown", {})`` where neither is listed."""
    model, flags = "unknown", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model name", "cpu model") and model == "unknown":
            model = " ".join(value.split())
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        if model != "unknown" and flags:
            break
    return model, flags


@functools.cache
def detect(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuIsa:
    """This host's :class:`CpuIsa` (cached: the CPU does not change under a running process)."""
    import torch

    try:
        model, flags = parse_cpuinfo(cpuinfo.read_text())
    except OSError:
        model, flags = "unknown", frozenset()
    return CpuIsa(model, flags, torch.backends.cpu.get_cpu_capability())


def gemm_dtype(isa: CpuIsa) -> str:
    """The dtype multi-row GEMMs multiply in: ``bfloat16`` where AMX or AVX-512 BF16 computes it, else ``float32``."""
    return "bfloat16" if isa.bf16_native else "float32"


def describe(isa: CpuIsa) -> str:
    """One line: the model, the GEMM flags, torch's capability and the GEMM dtype chosen from them."""
    flags = " ".join(isa.gemm_flags) or "none of " + " ".join(GEMM_FLAGS)
    why = "native bf16 dot products" if isa.bf16_native else "no native bf16 (AMX or AVX-512 BF16)"
    return f"{isa.model}: {flags} (torch kernels: {isa.torch_capability}); batch GEMMs in {gemm_dtype(isa)} ({why})"

