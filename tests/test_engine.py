"""Engine behaviour on a tiny random Llama: batching, prefix caching, preemption, sampling, stops, logprobs."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_tiny_model
from weft import LLM, SamplingParams
from weft.runner.sampler import RowParams, filter_logits

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", tokenizer_files)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 1024, "max_num_batched_tokens": 128})


def prompts(count=6, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 49152, (int(length),), generator=generator).tolist()
        for length in torch.randint(2, 60, (count,), generator=generator)
    ]


def token_ids(outputs):
    return [output.outputs[0].token_ids for output in outputs]


def test_batched_equals_one_at_a_time(llm):
    batch = prompts()
    together = token_ids(llm.generate(batch, GREEDY))
    alone = [token_ids(llm.generate([prompt], GREEDY))[0] for prompt in batch]
    assert together == alone


def test_prefix_cache_hits_give_the_same_tokens(tiny_model):
    shared = list(range(500, 540))
    batch = [shared + tail for tail in ([7, 8, 9], [10], [11, 12, 13, 14, 15])]
    cold = LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 512, "enable_prefix_caching": False})
    expected = token_ids(cold.generate(batch, GREEDY))
    assert cold.engine.kv_cache_manager.stats.hit_tokens == 0
    warm = LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 512})
    first = token_ids(warm.generate(batch[:1], GREEDY))
    again = token_ids(warm.generate(batch, GREEDY))
    stats = warm.engine.kv_cache_manager.stats
    assert stats.hits >= 2 and stats.hit_tokens >= 2 * 40
    assert first[0] == expected[0] and again == expected
    # The cached blocks of the generated tokens are reused too: a prompt extending a previous output.
    extended = batch[0] + expected[0][:12]
    assert token_ids(warm.generate([extended], GREEDY)) == token_ids(cold.generate([extended], GREEDY))


def test_preemption_gives_the_same_tokens(tiny_model, llm):
    batch = prompts(8, seed=5)
    expected = token_ids(llm.generate(batch, GREEDY))
    # 64 blocks of 4 tokens: enough for one request of max_model_len 256, far from all eight at once.
    tight = LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 64, "max_model_len": 256})
    outputs = tight.generate(batch, GREEDY)
    assert token_ids(outputs) == expected
    assert tight.engine.kv_cache_manager.usage() == 0.0


def test_preemption_happens_in_the_tight_configuration(tiny_model):
    tight = LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 64, "max_model_len": 256})
    engine = tight.engine
    requests = [engine.add_request(str(index), prompt, GREEDY) for index, prompt in enumerate(prompts(8, seed=5))]
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.num_preemptions > 0
    assert all(len(request.output_token_ids) == GREEDY.max_tokens for request in requests)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = prompts(1)[0]
    first = token_ids(llm.generate([prompt], params))[0]
    # Same seed, different batch company: same tokens.
    second = token_ids(
        llm.generate([prompts(1, seed=9)[0], prompt], [SamplingParams(temperature=1.0, max_tokens=5), params])
    )[1]
    assert first == second
    other = token_ids(
        llm.generate([prompt], copy.copy(SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)))
    )[0]
    assert other != first
    two = llm.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True))[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids != two.outputs[1].token_ids


def test_max_tokens_and_stop_token_ids(llm):
    prompt = prompts(1)[0]
    greedy = token_ids(llm.generate([prompt], GREEDY))[0]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert output.token_ids == greedy[:5] and output.finish_reason == "length"
    stop_at = greedy[6]
    first = greedy.index(stop_at)
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]))[0].outputs[
        0
    ]
    assert output.token_ids == greedy[: first + 1]
    assert output.finish_reason == "stop" and output.stop_reason == stop_at


def test_stop_strings_never_leak(llm):
    prompt = prompts(1)[0]
    full = llm.generate([prompt], GREEDY)[0].outputs[0].text
    assert len(full) > 20
    stop = full[10:14]
    cut = full.index(stop)
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[
        0
    ].outputs[0]
    assert output.text == full[:cut] and output.finish_reason == "stop" and output.stop_reason == stop
    kept = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == full[: cut + len(stop)]


def test_greedy_with_repetition_penalty_matches_hf(tiny_model, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt = prompts(1, seed=11)[0]
    generated = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=20,
        do_sample=False,
        repetition_penalty=1.8,
        eos_token_id=-1,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.8))
    assert ours[0].outputs[0].token_ids == generated


def test_presence_and_frequency_penalties_follow_openai(llm):
    from weft.contracts.executor import NewRequest
    from weft.runner.penalties import TokenCounts, apply_penalties
    from weft.runner.request_state import RequestState

    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    request = RequestState(NewRequest("r", [1, 2, 5, 5, 7], 2, params, (), ((),), 0), torch.device("cpu"))
    logits = torch.zeros(1, 10)
    apply_penalties(logits, [request], TokenCounts(torch.device("cpu")))
    expected = torch.zeros(10)
    expected[5] = -(0.25 * 2 + 0.5)
    expected[7] = -(0.25 * 1 + 0.5)
    torch.testing.assert_close(logits[0], expected)


def test_logprobs_equal_hf_log_softmax(tiny_model, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompt = prompts(1, seed=12)[0]
    result = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=-1,
        pad_token_id=0,
    )
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))[
        0
    ].outputs[0]
    assert output.token_ids == result.sequences[0, len(prompt) :].tolist()
    for step, (token, entries) in enumerate(zip(output.token_ids, output.logprobs, strict=False)):
        reference = torch.log_softmax(result.logits[step][0].float(), dim=-1)
        top = reference.topk(3)
        assert entries[token].rank == 1
        assert abs(entries[token].logprob - float(reference[token])) < 1e-4
        for rank, (value, index) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=False), start=1):
            assert abs(entries[index].logprob - value) < 1e-4 and entries[index].rank == rank


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
    ],
)
def test_filters_keep_the_same_tokens_as_hf_warpers(params):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k > 0:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0:
        warpers.append(MinPLogitsWarper(params.min_p))
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1, 300, generator=generator) * 3
        expected = warpers(torch.zeros(1, 1, dtype=torch.long), logits.clone())[0]
        ours = filter_logits(logits, RowParams([params], logits.shape[-1], logits.device))[0]
        assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))
        torch.testing.assert_close(ours.softmax(-1), expected.softmax(-1))


def test_bad_input_is_refused_with_the_field_and_value(llm):
    with pytest.raises(ValueError, match=r"SamplingParams.temperature = -1: must be >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"SamplingParams.top_p = 0: must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"prompt: 600 tokens, but the context length is 512"):
        llm.generate([[5] * 600], GREEDY)
    with pytest.raises(ValueError, match=r"prompt: token ids must be in \[0, 49152\)"):
        llm.generate([[5, 49152]], GREEDY)
    # Nothing is left behind: the engine still serves.
    assert not llm.engine.has_unfinished
    assert token_ids(llm.generate([[5, 6, 7]], GREEDY))[0]


def test_hooks_see_the_engine_and_every_finished_request(llm):
    from weft_example_bytes import hooks

    before = hooks.finished["length"]
    llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert hooks.finished["length"] == before + 3


def test_use_ops_names_are_checked_and_forced_implementations_used(tiny_model):
    with pytest.raises(
        ValueError, match=r"use.ops names \['softmax'\], which no installed plugin implements; known ops: .*linear"
    ):
        LLM(model=str(tiny_model), use={"ops": {"softmax": "torch"}}, engine={"num_kv_blocks": 64})
    llm = LLM(model=str(tiny_model), use={"ops": {"linear": "torch"}}, engine={"num_kv_blocks": 64})
    assert {name: type(op).__name__ for name, op in llm.engine.worker.ops.items()} == {
        "linear": "LinearTorch",
        "rms_norm": "RmsNormTorch",
        "rotary": "RotaryTorch",
        "qk_norm_rotary": "QkNormRotaryTorch",
        "silu_and_mul": "SiluAndMulTorch",
        "decode_topk": "DecodeTopKTorch",
        "bitmask_argmax": "BitmaskArgmaxTorch",
        "moe": "MoETorch",
        "nano_batches": "NanoBatchesStreams",  # the device's streams: inline on the CPU
    }
