"""Structured outputs on an NVIDIA GPU: the bitmask applied on the device, and constrained greedy decoding
(CUDA graphs, asynchronous scheduling, xgrammar's threaded fill of 32 rows) against transformers under
xgrammar's own logits processor, on identical float32 weights."""

from __future__ import annotations

import json

import pytest
import torch

from test_xgrammar_backend import TOOL_CALL, hf_constrained_greedy
from weft import LLM, SamplingParams
from weft.contracts.structured_output import StructuredOutputsParams
from weft.runner.logits_processors import TokenBitmask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def test_the_bitmask_applied_on_the_gpu_equals_xgrammars_kernel():
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    vocab, rows = 151936, 48
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(rows + 5, vocab, generator=generator).cuda()
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected[5:], bitmask.cuda())
    TokenBitmask(logits.device).apply(logits, list(range(5, rows + 5)), bitmask.numpy().tobytes())
    assert torch.equal(logits, expected)


def test_constrained_greedy_on_gpu_equals_transformers(tmp_path, tokenizer_files):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    prompts = [[1, 5, 9, 100 + index, 31, 7 * index] for index in range(32)]
    expected = hf_constrained_greedy(folder, prompts, TOOL_CALL, 40)
    llm = LLM(model=str(folder), use={"platform": "cuda"}, engine={"dtype": "float32", "max_num_seqs": 32})
    runner = llm.engine.runner
    assert runner.graphs and llm.engine.core.async_scheduling and runner.mask_graphs is not None
    real, replays = runner.mask_graphs.sample, []
    runner.mask_graphs.sample = lambda *args: replays.append(args[:2]) or real(*args)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=TOOL_CALL))
    outputs = llm.generate(prompts, params)
    llm.close()
    assert len(replays) >= 30  # the decode steps masked and sampled in the mask graph (CUDA graphs)
    for output, reference in zip(outputs, expected, strict=False):
        tokens = output.outputs[0].token_ids
        assert tokens == reference[: len(tokens)] and len(reference) - len(tokens) <= 1  # HF keeps the final EOS
        if output.outputs[0].finish_reason == "stop":
            # strict=False: xgrammar 0.2.9's rule for a string with maxLength admits raw control characters
            # (its plain string rule does not); both Weft and the reference follow the grammar xgrammar built.
            assert json.loads(output.outputs[0].text, strict=False).keys() == TOOL_CALL["properties"].keys()
