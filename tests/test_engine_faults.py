"""Engine-side isolation, in process: non-finite logits fail one row, a failed step is retried once,
long prefills leave room for short requests, extreme sampling values are refused or made safe."""

from __future__ import annotations

import math

import pytest
import torch

from weft import LLM, SamplingParams
from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
from weft.engine.core.kv_cache_manager import KVCacheManager
from weft.engine.core.request import Request
from weft.engine.core.scheduler import Scheduler
from weft.runner.sampler import NON_FINITE_LOGITS, Sampler


class Row:
    """The sampler's view of one request."""

    def __init__(self, params: SamplingParams, output: tuple[int, ...] = ()) -> None:
        self.request_id = f"r{id(self)}"
        self.params = params
        self.prompt_token_ids = [1, 2, 3]
        self.output_token_ids = list(output)
        self.eos_token_ids = frozenset({0})
        self.generator = None


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_row_fails_alone_greedy_and_sampled(poison):
    logits = torch.randn(4, 50)
    logits[2, 7] = poison
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=2)
    for params in (greedy, sampled):
        rows = [Row(params) for _ in range(4)]
        tokens = Sampler()(logits, rows)
        assert tokens[2].error == NON_FINITE_LOGITS
        assert all(token.error is None and 0 <= token.token_id < 50 for index, token in enumerate(tokens) if index != 2)
    minus_inf = torch.full((1, 50), float("-inf"))
    assert Sampler()(minus_inf, [Row(greedy)])[0].error == NON_FINITE_LOGITS


def test_a_sampling_exception_fails_only_its_row(monkeypatch):
    from weft.runner import sampler as module

    real = module.filter_logits

    def flaky(logits, rows):
        if (rows.top_k == 3).any():  # the batch holding the row with top_k 3, then that row alone
            raise RuntimeError("boom")
        return real(logits, rows)

    monkeypatch.setattr(module, "filter_logits", flaky)
    rows = [Row(SamplingParams(temperature=1.0, top_k=3)), Row(SamplingParams(temperature=1.0))]
    tokens = Sampler()(torch.randn(2, 20), rows)
    assert tokens[0].error is not None and "boom" not in tokens[0].error
    assert tokens[1].error is None


def test_sampling_values_that_would_overflow_are_refused_or_greedy():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    for field, value in (
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("presence_penalty", -math.inf),
    ):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    # At the bounds, the sampler's float32 logits stay finite.
    logits = torch.randn(2, 40) * 30
    rows = [
        Row(SamplingParams(temperature=1e-5, repetition_penalty=0.01)),
        Row(
            SamplingParams(temperature=2.0, repetition_penalty=100.0, presence_penalty=2, frequency_penalty=-2),
            (1, 1, 2),
        ),
    ]
    assert all(token.error is None for token in Sampler()(logits, rows))


def _scheduler(threshold: int, budget: int = 2048) -> Scheduler:
    groups = [
        KVCacheGroupSpec(
            "full", ("layer",), FullAttentionSpec(block_size=16, dtype="float32", num_kv_heads=1, head_dim=8)
        )
    ]
    return Scheduler(KVCacheManager(groups, [4096], True), 16, budget, 16384, True, None, threshold, 1)


@pytest.mark.parametrize("threshold", [0, 512])
def test_a_short_request_waits_for_a_long_prefill_only_without_the_cap(threshold):
    scheduler = _scheduler(threshold)
    params = SamplingParams(max_tokens=4)
    scheduler.add(Request("long", list(range(100, 8100)), params, 4, frozenset()))
    first = scheduler.schedule()
    scheduler.update_from_output(first, _no_tokens(first), None)
    scheduler.add(Request("short", [5, 6, 7], params, 4, frozenset()))
    steps = 1
    while "short" not in scheduler.schedule().num_scheduled_tokens:
        steps += 1
    if threshold:
        assert steps == 1  # admitted in the first step after it arrived; the long prefill took what was left
        assert first.num_scheduled_tokens["long"] == 2048  # alone, the long prefill used the whole budget
    else:
        assert steps == 3  # the old behaviour: behind every chunk of the 8,000-token prompt (the last leaves room)


def test_only_max_long_partial_prefills_long_prompts_run_at_once():
    scheduler = _scheduler(256)
    params = SamplingParams(max_tokens=4)
    scheduler.add(Request("long1", list(range(100, 2100)), params, 4, frozenset()))
    scheduler.add(Request("long2", list(range(200, 2200)), params, 4, frozenset()))
    scheduler.add(Request("short", [5, 6, 7], params, 4, frozenset()))
    step = scheduler.schedule().num_scheduled_tokens
    assert set(step) == {"long1", "short"}  # long2 waits its turn; the short one behind it does not
    assert step == {"long1": 2000, "short": 3}  # the budget the short one left went back to long1


def _no_tokens(step):
    from weft.contracts.executor import ModelRunnerOutput

    ids = list(step.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [None] * len(ids))


def faulty(real, calls: dict, fails, message: str):
    """``real`` (an executor's ``execute_model``) raising ``message`` on the calls ``fails(call)`` picks, counted
    from 1 in ``calls["count"]``."""

    def execute_model(step):
        calls["count"] += 1
        if fails(calls["count"]):
            raise RuntimeError(message)
        return real(step)

    return execute_model


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, tokenizer_files, one_torch_thread):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", tokenizer_files)
    llm = LLM(model=str(folder), engine={"num_kv_blocks": 256})
    yield llm
    llm.close()


def test_a_failed_step_is_retried_once_then_fails_everything(tiny_llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["Once upon a time", "The sea is"]
    expected = [output.outputs[0].token_ids for output in tiny_llm.generate(prompts, params)]
    executor = tiny_llm.engine.core.executor
    real = executor.execute_model
    calls = {"count": 0}

    monkeypatch.setattr(
        executor, "execute_model", faulty(real, calls, lambda call: call == 5, "a transient device error")
    )
    retried = [output.outputs[0].token_ids for output in tiny_llm.generate(prompts, params)]
    assert retried == expected  # the running requests were recomputed: same greedy tokens

    def always_fails(step):
        raise RuntimeError("a broken device")

    monkeypatch.setattr(executor, "execute_model", always_fails)
    with pytest.raises(RuntimeError, match="broken device"):
        tiny_llm.generate(prompts, params)
    monkeypatch.setattr(executor, "execute_model", real)
    assert [output.outputs[0].token_ids for output in tiny_llm.generate(prompts, params)] == expected
    assert tiny_llm.engine.kv_cache_manager.usage() == 0.0


def test_a_fault_on_every_other_call_is_not_retried_forever(tmp_path, tokenizer_files, one_torch_thread, monkeypatch):
    """Asynchronous scheduling: after a failed step the next call only launches the recomputed prefill (it
    produces nothing), so a fault failing every other call fails again before any progress, which raises; it
    used to count as a first failure each time and retry forever."""
    from conftest import make_tiny_model

    llm = LLM(
        model=str(make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)),
        engine={"num_kv_blocks": 256, "async_scheduling": True},
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = [output.outputs[0].token_ids for output in llm.generate(["Once upon a time"], params)]
        executor = llm.engine.core.executor
        real = executor.execute_model
        calls = {"count": 0}

        monkeypatch.setattr(
            executor,
            "execute_model",
            faulty(real, calls, lambda call: call > 2 and call % 2 == 1, "a fault on every other call"),
        )
        with pytest.raises(RuntimeError, match="every other call"):
            llm.generate(["Once upon a time"], params)
        assert calls["count"] <= 6
        monkeypatch.setattr(executor, "execute_model", real)
        assert [output.outputs[0].token_ids for output in llm.generate(["Once upon a time"], params)] == expected

        # A failure whose requests were then aborted (the core idle) does not count against the next request.
        calls["count"] = 0

        monkeypatch.setattr(executor, "execute_model", faulty(real, calls, lambda call: call == 2, "a transient fault"))
        llm.engine.add_request("dropped", llm.tokenizer.encode("The sea is"), params, stream_text=False)
        while calls["count"] < 2:
            llm.engine.step()  # the second call fails: its request is preempted, to be recomputed
        llm.engine.abort("dropped")  # then its client goes: nothing is left to step
        assert not llm.engine.core.has_work and llm.engine.core._retries.failed_steps == 1
        calls["count"] = 0
        assert [output.outputs[0].token_ids for output in llm.generate(["Once upon a time"], params)] == expected
    finally:
        llm.close()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")],
        ),
    ],
)
def test_nan_activations_of_one_request_never_reach_another(device, tmp_path, tokenizer_files, one_torch_thread):
    """Concurrently (padded decode batches) and afterwards (recycled blocks), other requests' tokens are
    those they get alone; the request whose logits are NaN finishes with ``error``. On CUDA: Triton
    attention, graphs and the device-side greedy path."""
    from conftest import POISONED_TEXT, poisoned_model

    platform = {"use": {"platform": "cuda"}} if device == "cuda" else {}
    llm = LLM(
        model=str(poisoned_model(tmp_path / "poisoned", tokenizer_files)),
        engine={"num_kv_blocks": 48, "max_model_len": 512},
        **platform,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        prompts = [f"Count from {index} to {index + 9}:" for index in range(3)]
        alone = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
        mixed = llm.generate([*prompts, "Tell me about the xylophone.", POISONED_TEXT], params)
        # "xylophone" holds the poisoned token mid-prompt. The torch backend stores non-finite keys and values
        # as zeros, so its later positions stay finite; Triton attention keeps them (its masked loads keep
        # them from other requests' rows), so that request's own logits turn NaN and it alone fails too.
        xylophone = "length" if device == "cpu" else "error"
        assert [output.outputs[0].finish_reason for output in mixed] == ["length"] * 3 + [xylophone, "error"]
        assert [output.outputs[0].token_ids for output in mixed[:3]] == alone
        llm.generate([POISONED_TEXT, "Tell me about the xylophone."] * 3, params)  # their blocks go back to the pool
        assert [output.outputs[0].token_ids for output in llm.generate(prompts, params)] == alone
    finally:
        llm.close()
