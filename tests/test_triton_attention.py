"""weft-cuda's Triton attention kernel passes the attention contract: on the CPU under Triton's
interpreter (small shapes), and on an NVIDIA GPU in bf16 when one is present."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from weft.testing import AttentionContract  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
class TestTritonAttentionInterpreted(AttentionContract):
    plugin_name = "triton"
    head_dims = (64,)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs an NVIDIA GPU")
class TestTritonAttentionOnGPU(AttentionContract):
    plugin_name = "triton"
    device = "cuda"
    dtype = "bfloat16"
    tolerance = (2e-2, 2e-2)
    head_dims = (64, 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1 to run Triton on the CPU")
class TestTritonAttentionInterpretedSmallBlocks(AttentionContract):
    plugin_name = "triton"
    head_dims = (32,)
    block_size = 4
