"""The ``draft`` speculator: a model of the target's vocabulary proposes greedily from its own paged KV cache.

Greedy output is identical with speculation off, with a tiny random draft of another size, and with a self-draft
(the target as its own draft, whose greedy proposals the target must accept every time); in mixed batches with n=2
and stop strings too; the draft's blocks come back to the pool when the requests are done.
"""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from test_speculative import ENGINE, GREEDY, repetitive_prompts, spec_counts, token_ids
from weft import LLM, SamplingParams
from weft.config import ConfigError


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_files):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root / "target", "llama", tokenizer_files, vocab_size=512)
    draft = make_tiny_model(
        root / "draft",
        "llama",
        tokenizer_files,
        seed=3,
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    return target, draft


@pytest.fixture(scope="module")
def plain(models):
    llm = LLM(model=str(models[0]), engine=ENGINE)
    yield llm
    llm.close()


def speculating(target, draft, k=3):
    return LLM(
        model=str(target),
        engine={**ENGINE, "speculative": {"method": "draft", "model": str(draft), "num_speculative_tokens": k}},
    )


@pytest.fixture(scope="module")
def self_draft(models):
    llm = speculating(models[0], models[0], k=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def small_draft(models):
    llm = speculating(models[0], models[1])
    yield llm
    llm.close()


def free_blocks(llm):
    return [pool.num_free for pool in llm.engine.core.scheduler.kv_cache.pools]


def test_self_draft_is_identical_and_accepts_every_greedy_proposal(plain, self_draft):
    prompts = repetitive_prompts(count=6)
    expected = token_ids(plain.generate(prompts, GREEDY))
    got = token_ids(self_draft.generate(prompts, GREEDY))
    assert got == expected
    drafted, accepted = spec_counts(self_draft)
    assert drafted > 0 and accepted == drafted


def test_a_smaller_random_draft_leaves_greedy_output_unchanged(plain, small_draft):
    prompts = repetitive_prompts(count=6, seed=11)
    expected = token_ids(plain.generate(prompts, GREEDY))
    got = token_ids(small_draft.generate(prompts, GREEDY))
    assert got == expected
    drafted, _ = spec_counts(small_draft)
    assert drafted > 0


def test_mixed_batch_with_n_2_and_stop_strings(plain, self_draft):
    prompts = repetitive_prompts(count=4, seed=21)
    params = [
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, n=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop_token_ids=[7]),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    ]
    expected = plain.generate(prompts, params)
    got = self_draft.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    text = expected[1].outputs[0].text
    if len(text) > 6:
        stop = text[3:6]
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        assert (
            self_draft.generate([prompts[1]], params)[0].outputs[0].text
            == plain.generate([prompts[1]], params)[0].outputs[0].text
        )


def test_the_draft_blocks_come_back(small_draft):
    before = free_blocks(small_draft)
    assert len(before) == 2  # the target's group, then the draft's
    small_draft.generate(repetitive_prompts(count=12, seed=31), SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    assert free_blocks(small_draft) == before


def test_draft_without_a_model_is_refused(models):
    with pytest.raises(ConfigError, match="engine.speculative.model"):
        LLM(model=str(models[0]), engine={**ENGINE, "speculative": {"method": "draft"}})
