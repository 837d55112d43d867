"""Speculative decoding through the engine: proposals verified in one step leave the output as plain decoding's.

Greedy output is identical with speculation off and with ``ngram``; seeded sampling draws the same tokens;
rejected proposals leave no KV block behind; stops, ``max_tokens``, structured outputs, logprobs, preemption and
prefix caching cut and count as without speculation. (The chi-square test of the sampled distribution is in
test_speculative_draft.py, whose draft proposals are accepted often enough to test both paths.)
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model
from weft import LLM, SamplingParams

ENGINE = {"block_size": 4, "num_kv_blocks": 1024, "max_num_batched_tokens": 128}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("spec") / "llama", "llama", tokenizer_files, vocab_size=512)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(model=str(tiny_llama), engine=ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ngram(tiny_llama):
    llm = LLM(model=str(tiny_llama), engine={**ENGINE, "speculative": NGRAM})
    yield llm
    llm.close()


def repetitive_prompts(count=8, seed=5):
    """Prompts that repeat a random passage (with an edit), so prompt lookup finds what follows."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for index in range(count):
        passage = torch.randint(3, 512, (int(torch.randint(6, 20, (1,), generator=generator)),), generator=generator)
        passage = passage.tolist()
        edited = list(passage)
        edited[index % len(edited)] = 7
        prompts.append([*passage, *passage, *edited, *passage[: 3 + index % 4]])
    return prompts


def token_ids(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def spec_counts(llm):
    stats = llm.engine.core.stats()
    return stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens


def test_greedy_output_is_identical_with_ngram(plain, ngram):
    prompts = repetitive_prompts()
    expected = token_ids(plain.generate(prompts, GREEDY))
    drafted_before, accepted_before = spec_counts(ngram)
    got = token_ids(ngram.generate(prompts, GREEDY))
    assert got == expected
    drafted, accepted = spec_counts(ngram)
    assert drafted > drafted_before and accepted > accepted_before  # it did speculate, and some proposals held


def test_acceptance_shows_in_the_counters(ngram):
    stats = ngram.engine.core.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    per_position = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_position) == NGRAM["num_speculative_tokens"]
    assert sum(per_position) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_position, per_position[1:], strict=False))  # j kept only after j - 1


def test_seeded_sampling_draws_the_same_tokens(plain, ngram):
    """With the same logits, a seeded request draws the noise of each position from its seed and the position:
    the tokens are those plain decoding draws, accepted proposals or not."""
    prompts = repetitive_prompts(6, seed=9)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=100 + index, max_tokens=30)
        for index in range(len(prompts))
    ]
    assert token_ids(ngram.generate(prompts, params)) == token_ids(plain.generate(prompts, params))


def test_penalties_and_logit_bias_apply_per_position(plain, ngram):
    prompts = repetitive_prompts(4, seed=11)
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        logit_bias={prompts[0][-1]: 2.0},
    )
    assert token_ids(ngram.generate(prompts, params)) == token_ids(plain.generate(prompts, params))


def test_stops_max_tokens_logprobs_and_n_cut_inside_an_accepted_run(plain, ngram):
    prompts = repetitive_prompts(6, seed=13)
    reference = token_ids(plain.generate(prompts, GREEDY))
    # Stop on a token the greedy continuation reaches mid-run, and cut max_tokens at odd lengths.
    params = [
        SamplingParams(
            temperature=0, max_tokens=7 + index, ignore_eos=True, stop_token_ids=[reference[index][5]], logprobs=2
        )
        for index in range(len(prompts))
    ]
    want, got = plain.generate(prompts, params), ngram.generate(prompts, params)
    for expected, actual in zip(want, got, strict=True):
        assert actual.outputs[0].token_ids == expected.outputs[0].token_ids
        assert actual.outputs[0].finish_reason == expected.outputs[0].finish_reason
        assert actual.outputs[0].text == expected.outputs[0].text
        for mine, theirs in zip(actual.outputs[0].logprobs, expected.outputs[0].logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
    two = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    assert [[completion.token_ids for completion in output.outputs] for output in ngram.generate(prompts[:3], two)] == [
        [completion.token_ids for completion in output.outputs] for output in plain.generate(prompts[:3], two)
    ]


def test_stop_strings_cut_inside_an_accepted_run(plain, ngram):
    prompts = repetitive_prompts(4, seed=17)
    texts = [output.outputs[0].text for output in plain.generate(prompts, GREEDY)]
    for prompt, text in zip(prompts, texts, strict=True):
        stop = text[len(text) // 3 : len(text) // 3 + 3]
        if not stop.strip():
            continue
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        want, got = plain.generate([prompt], params)[0].outputs[0], ngram.generate([prompt], params)[0].outputs[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


def test_structured_outputs_in_a_mixed_batch(plain, ngram):
    pytest.importorskip("weft_xgrammar")
    from weft.contracts.structured_output import StructuredOutputsParams

    prompts = repetitive_prompts(6, seed=19)
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}"))
        if index % 2
        else GREEDY
        for index in range(len(prompts))
    ]
    assert token_ids(ngram.generate(prompts, params)) == token_ids(plain.generate(prompts, params))


def test_preemption_and_no_block_leaks_after_200_mixed_requests(tiny_llama, plain):
    """A cache too small for the batch preempts speculating requests; after 200 requests of every kind, every block
    is free again."""
    tight = LLM(
        model=str(tiny_llama),
        engine={"block_size": 4, "num_kv_blocks": 96, "max_model_len": 256, "speculative": NGRAM},
    )
    try:
        generator = torch.Generator().manual_seed(23)
        prompts = repetitive_prompts(200, seed=29)
        params = []
        for index in range(200):
            kind = index % 4
            if kind == 0:
                params.append(
                    SamplingParams(temperature=0, max_tokens=int(torch.randint(1, 40, (1,), generator=generator)))
                )
            elif kind == 1:
                params.append(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=25, seed=index))
            elif kind == 2:
                params.append(
                    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[prompts[index][2]])
                )
            else:
                params.append(SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, logprobs=1))
        greedy = [index for index in range(200) if index % 4 in (0, 2)]
        outputs = tight.generate(prompts, params)
        expected = plain.generate([prompts[index] for index in greedy], [params[index] for index in greedy])
        assert [outputs[index].outputs[0].token_ids for index in greedy] == token_ids(expected)
        manager = tight.engine.kv_cache_manager
        assert tight.engine.scheduler.num_preemptions > 0
        assert manager.usage() == 0.0
        assert not tight.engine.scheduler.requests
    finally:
        tight.close()


def test_weft_serve_with_speculative_config_and_its_metrics(tiny_llama, plain):
    """``weft serve --speculative-config JSON`` (a real process) answers the official client as plain decoding
    does, and ``/metrics`` carries the spec_decode counters."""
    import json
    import os

    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import free_port, start_weft_serve

    port = free_port()
    server, _ = start_weft_serve(
        [str(tiny_llama), "--speculative-config", json.dumps(NGRAM), "--num-kv-blocks", "1024", "--block-size", "4"],
        port,
        dict(os.environ),
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        prompt = repetitive_prompts(1, seed=31)[0]
        answer = client.completions.create(model="llama", prompt=prompt, max_tokens=30, temperature=0)
        expected = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
        assert answer.choices[0].text == expected
        streamed = "".join(
            chunk.choices[0].text
            for chunk in client.completions.create(
                model="llama", prompt=prompt, max_tokens=30, temperature=0, stream=True
            )
        )
        assert streamed == expected
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        samples = {
            (sample.name, sample.labels.get("position")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
        assert samples[("weft_spec_decode_num_drafts_total", None)] > 0
        drafted = samples[("weft_spec_decode_num_draft_tokens_total", None)]
        accepted = samples[("weft_spec_decode_num_accepted_tokens_total", None)]
        assert drafted > 0 and 0 <= accepted <= drafted
        per_position = [samples[("weft_spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(4)]
        assert sum(per_position) == accepted
    finally:
        server.terminate()
        server.wait(timeout=60)
