"""The engine core's step profile: what it counts per step, the device timeline it derives,
and that unset it changes nothing."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from weft import LLM, SamplingParams
from weft.contracts.executor import CachedRequest, DoneStep, ModelRunnerOutput, NewRequest, SchedulerOutput
from weft.engine.core.step_profile import StepProfile


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("profile") / "llama", "llama", tokenizer_files)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_profiled_run_counts_every_token_and_gives_the_unprofiled_tokens(
    tiny_model, one_torch_thread, async_scheduling
):
    import torch

    prompts = [
        torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        for length in (20, 33, 7, 50, 12, 41)
    ]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm = LLM(
        model=str(tiny_model),
        engine={
            "num_kv_blocks": 256,
            "max_num_batched_tokens": 48,
            "async_scheduling": async_scheduling,
            "enable_prefix_caching": False,
        },
    )
    plain = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    profile = StepProfile(llm.engine.runner)
    llm.engine.core.step_profile = profile
    profile.start()
    profiled = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    profile.stop()
    llm.engine.core.step_profile = None
    assert profiled == plain
    records = profile.records
    assert sum(record.prefill_tokens for record in records) == sum(map(len, prompts))
    # Each request samples once at the end of its prompt, then decodes its 8 other tokens.
    assert sum(record.sampled_tokens for record in records) == 9 * len(prompts)
    assert sum(record.decode_tokens for record in records) == 8 * len(prompts)
    phases = [record.phase for record in records]
    assert phases[0] == "prefill" and "mixed" in phases and phases.count("decode/eager") >= 7
    assert all(record.requests <= 48 for record in records)
    # The CPU's timeline: before the first forward, the forwards, the gaps and the tail make up the wall.
    worked = [record for record in records if record.requests]
    total = sum(record.device + record.idle_before for record in worked) + profile.device_tail
    assert total == pytest.approx(profile.wall, rel=1e-6)
    assert all(0 <= record.before_launch <= record.end - record.start for record in records)
    llm.generate(prompts[:1], params)
    assert profile.records == records, "unset, the core records nothing"


class FakeEvent:
    """A timing event stamped with a fake device clock (seconds)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3


def test_the_device_timeline_comes_from_the_events_around_each_launch(monkeypatch):
    """Three steps whose device work starts and ends where a fake clock says: spans and idle gaps follow."""
    import torch

    class Runner:
        device = torch.device("cuda", 0)
        last_graph_size = None

    stamps = iter([0.0, 1.0, 3.0, 3.5, 7.0, 7.0, 9.0, 10.0])
    """The run's start; then each step's begin and end; the run's end (seconds on the device)."""
    monkeypatch.setattr(StepProfile, "_event", lambda self: FakeEvent(next(stamps)))
    monkeypatch.setattr(StepProfile, "_synchronize", lambda self: None)
    runner = Runner()
    profile = StepProfile(runner)

    class Executor:
        def execute_model(self, output):
            request_ids = list(output.num_scheduled_tokens)
            return DoneStep(ModelRunnerOutput(request_ids, [None] * len(request_ids)))

    new = [NewRequest(name, [5] * 4, 4, SamplingParams(), (), ((0,),), 0) for name in "ab"]
    steps = [
        SchedulerOutput(new, [], {"a": 4, "b": 4}),
        SchedulerOutput([], [CachedRequest("a", 4, None), CachedRequest("b", 4, None)], {"a": 1, "b": 1}),
        SchedulerOutput([], [CachedRequest("a", 5, None)], {"a": 1}),
    ]
    profile.start()
    for index, output in enumerate(steps):
        with profile.step():
            profile.scheduled(output, 2, 0)
            runner.last_graph_size = None if index == 0 else 2
            profile.result(profile.execute(Executor(), output))
    profile.stop()
    records = profile.records
    assert [record.phase for record in records] == ["prefill", "decode/graph", "decode/graph"]
    assert [record.device for record in records] == [2.0, 3.5, 2.0]
    assert [record.idle_before for record in records] == [1.0, 0.5, 0.0]
    assert profile.device_tail == 1.0
    assert [(record.prefill_tokens, record.decode_tokens, record.sampled_tokens) for record in records] == [
        (8, 0, 2),
        (0, 2, 2),
        (0, 1, 1),
    ]
