"""Where weft-triton's kernels can run, and whether Triton compiles them or interprets them."""

from __future__ import annotations

import os
from typing import Any

from weft.contracts.gpu_platform import triton_backend_installed

MISSING_TRITON = (
    "needs the triton package: on NVIDIA pip install 'weft-cuda[kernels]' (or triton>=3.3); ROCm and XPU builds "
    "of torch bring theirs (pytorch-triton-rocm, pytorch-triton-xpu)"
)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``): nothing to compile."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(platform: Any) -> bool:
    """Whether ``platform`` names a Triton backend (``GpuPlatform.triton_backend``) that is installed here."""
    return triton_backend_installed(getattr(platform, "triton_backend", None))
