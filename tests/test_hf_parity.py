"""Greedy generation through Weft's engine equals Hugging Face transformers' generate() on the same weights."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TINY_CONFIGS, make_tiny_model, smollm2_gguf
from weft import LLM, SamplingParams

NEW_TOKENS = 64


def hf_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """HF generate(), one prompt at a time (no padding), never stopping at EOS (like ignore_eos).

    A stopping criterion that never fires replaces EOS stopping, so the logits are untouched.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = -1
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.pad_token_id = 0
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]), generation_config=config, stopping_criteria=StoppingCriteriaList([Never()])
        )
        outputs.append(generated[0, len(prompt) :].tolist())
        assert len(outputs[-1]) == new_tokens
    return outputs


def prompts_of_lengths(lengths, vocab=49152, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in lengths]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_tiny_random_models_match_hf(kind, tmp_path, tokenizer_files):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / kind, kind, tokenizer_files)
    prompts = prompts_of_lengths([1, 3, 7, 16, 17, 40, 90, 150])
    reference = hf_greedy(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(), prompts)
    # A small step budget and block size force chunked prefill and many blocks per request; with
    # asynchronous scheduling each decode reads the token the step before sampled from the device.
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(folder),
            engine={
                "max_num_batched_tokens": 96,
                "block_size": 8,
                "num_kv_blocks": 512,
                "async_scheduling": async_scheduling,
            },
        )
        assert llm.engine.core.async_scheduling is async_scheduling
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        for prompt, expected, output in zip(prompts, reference, outputs, strict=False):
            assert output.outputs[0].token_ids == expected, (
                f"prompt of {len(prompt)} tokens diverged (async {async_scheduling})"
            )


@pytest.fixture(scope="module")
def smollm2_llm():
    # The dense path (dequantized floats) is the one that equals transformers token for token; the quantized
    # default's agreement is tests/test_quantization.py's.
    return LLM(model="smollm2-135m-instruct", quantization="none")


def test_smollm2_gguf_matches_hf_loading_the_same_gguf(smollm2_llm):
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village by the sea, there lived",
        "List three primary colors:",
        "Translate to French: I like apples.",
        "What is 12 times 12? Answer:",
        "The quick brown fox jumps over the lazy dog. " * 6,
        "In 1969, humans first landed on the Moon. The mission was called",
    ]
    prompts = [smollm2_llm.tokenizer.encode(text) for text in texts]
    assert len({len(prompt) for prompt in prompts}) >= 6
    reference = hf_greedy(hf, prompts)
    outputs = smollm2_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for text, expected, output in zip(texts, reference, outputs, strict=False):
        assert output.outputs[0].token_ids == expected, f"diverged on {text!r}"


def test_smollm2_answers_a_chat(smollm2_llm):
    output = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=32)
    )[0].outputs[0]
    assert "Paris" in output.text and output.finish_reason == "stop"
