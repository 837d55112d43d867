"""Speculative decoding on CUDA: greedy output identical to plain decoding's, with a replay speculator (the
target's own greedy continuation, accepted in full) and with ``ngram``, through the Triton attention with and
without CUDA graphs and through the torch attention, on a model whose greedy path does not hinge on bf16 rounding
(:func:`tiny_llama`); verify graphs and the draft's graphs taken, their output equal to the eager engine's
(``enforce_eager``); seeded sampling reproducible. The CPU's tests are tests/test_speculative.py and
tests/test_speculative_graphs.py; these run where a GPU is (``-m gpu``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import damp_residual_branches, make_tiny_model
from test_speculative import NGRAM, repetitive_prompts, token_ids
from weft import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

BENCH = Path(__file__).resolve().parents[1] / "bench"
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PATHS = {
    "triton+graphs": ({}, {}),
    "triton eager": ({"enforce_eager": True}, {}),
    "triton eager, no async scheduling": ({"enforce_eager": True, "async_scheduling": False}, {}),
    "torch attention": ({"enforce_eager": True}, {"attention": "torch"}),
}


@pytest.fixture(scope="module")
def replay_registry():
    sys.path.insert(0, str(BENCH))
    try:
        from replay_speculator import ReplaySpeculator, registry_with_replay
    finally:
        sys.path.remove(str(BENCH))
    return ReplaySpeculator, registry_with_replay()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    """A tiny random Llama whose residual branches' output projections are scaled by 1e-3, so each greedy token
    is a function of the one before. In bf16 the verify step's attention launch and plain decoding's round
    differently (each within bf16 of exact attention: bench/gpu_probe_verify.py); on a model whose greedy path is
    chaotic that difference flips a near tie within a few tokens, and the comparison below would test rounding,
    not speculation. Here it tests speculation."""
    folder = make_tiny_model(tmp_path_factory.mktemp("spec_gpu") / "llama", "llama", tokenizer_files, vocab_size=512)
    return damp_residual_branches(folder)


def engine(**options):
    return {"dtype": "bfloat16", "gpu_memory_utilization": 0.2, "max_model_len": 512, **options}


@pytest.mark.parametrize("path", list(PATHS))
def test_replay_and_ngram_keep_greedy_output_on_cuda(tiny_llama, replay_registry, path):
    replay, registry = replay_registry
    options, use = PATHS[path]
    prompts = repetitive_prompts(8)
    plain = LLM(model=str(tiny_llama), registry=registry, use=use, engine=engine(**options))
    try:
        reference = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
        one = token_ids(plain.generate(prompts[:1], GREEDY, use_tqdm=False))
    finally:
        plain.close()
    assert one == reference[:1], "plain greedy decoding differs between batch 1 and batch 8"
    replay.continuations = {tuple(prompt): list(tokens) for prompt, tokens in zip(prompts, reference, strict=True)}
    for speculative in ({"method": "replay", "num_speculative_tokens": 4}, NGRAM):
        llm = LLM(model=str(tiny_llama), registry=registry, use=use, engine=engine(**options, speculative=speculative))
        try:
            outputs = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
            single = token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
            stats = llm.engine.core.stats()
        finally:
            llm.close()
        drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        first = next((i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b), None)
        assert first is None, (
            f"{speculative['method']} on {path}: request {first} differs from plain decoding "
            f"({outputs[first][:12]}... vs {reference[first][:12]}...); accepted {accepted} of {drafted}"
        )
        assert single == reference[:1]
        if speculative["method"] == "replay":
            assert accepted == drafted > 0, f"replay on {path}: accepted {accepted} of {drafted} proposals"


def test_seeded_sampling_is_reproducible_with_speculation_on_cuda(tiny_llama):
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=11, ignore_eos=True)
    llm = LLM(model=str(tiny_llama), engine=engine(speculative=NGRAM))
    try:
        first = token_ids(llm.generate(prompts, params, use_tqdm=False))
        again = token_ids(llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.close()
    assert first == again


@pytest.mark.parametrize("method", ["ngram", "draft", "self-draft"])
def test_verify_and_draft_graphs_give_the_eager_engines_output_on_cuda(tiny_llama, tokenizer_files, method, tmp_path):
    """Speculating steps replay verify graphs (rows of a last token and up to k proposals, padded to the captured
    batch size), and a draft's k - 1 one-token forwards replay its chained graph: greedy output equal to the
    eager engine's (``enforce_eager``) and to plain decoding's; a self-draft through its graphs accepts every
    proposal."""
    if method == "ngram":
        speculative = NGRAM
    else:
        draft = tiny_llama
        if method == "draft":  # a random draft of another size: its proposals are rarely the target's
            shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
            draft = make_tiny_model(
                tmp_path / "draft", "llama", tokenizer_files, seed=3, vocab_size=512, intermediate_size=64, **shape
            )
        speculative = {"method": "draft", "model": str(draft), "num_speculative_tokens": 3}
    prompts = repetitive_prompts(7)  # 7 rows: the batch-8 graphs, one padding row
    plain = LLM(model=str(tiny_llama), engine=engine())
    try:
        reference = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        plain.close()
    outputs, counts = {}, {}
    for eager in (True, False):
        llm = LLM(model=str(tiny_llama), engine=engine(enforce_eager=eager, speculative=speculative))
        try:
            runner = llm.engine.runner
            speculator = runner.speculation.speculator
            assert bool(runner.verify_graphs.graphs) is not eager
            outputs[eager] = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
            outputs[eager, "single"] = token_ids(llm.generate(prompts[:1], GREEDY, use_tqdm=False))
            stats = llm.engine.core.stats()
            counts[eager] = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
            if not eager:
                assert runner.verify_graphs.replays > 0, "no speculating step replayed a verify graph"
                if method != "ngram":
                    assert speculator.graphs is not None and speculator.graphs.replays > 0, "no draft graph replay"
        finally:
            llm.close()
    assert outputs[False] == outputs[True] == reference, f"{method}: acceptance (drafted, accepted) {counts}"
    assert outputs[False, "single"] == outputs[True, "single"] == reference[:1]
    drafted, accepted = counts[False]
    assert drafted > 0
    if method == "ngram":
        assert accepted > 0
    if method == "self-draft":
        assert accepted == drafted, f"a self-draft through graphs accepted {accepted} of {drafted}"
