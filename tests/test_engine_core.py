"""The engine core: one-way steps, the core in its own process, what happens when that process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from conftest import free_port, make_tiny_model, start_weft_serve
from weft import LLM, SamplingParams
from weft.contracts.executor import SchedulerOutput, decode_scheduler_output, encode_step


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("core") / "llama", "llama", tokenizer_files)


def test_steps_cross_to_the_worker_as_bytes_and_carry_blocks_only_when_they_grow(tiny_model):
    """What the scheduler sends is self-contained and survives msgpack; later steps send only new blocks."""
    llm = LLM(model=str(tiny_model), engine={"block_size": 4, "num_kv_blocks": 128, "max_num_batched_tokens": 8})
    engine = llm.engine
    sent: list[SchedulerOutput] = []
    execute = engine.core.executor.execute_model

    def recording(step):
        sent.append(decode_scheduler_output(encode_step(step)))
        return execute(step)

    engine.core.executor.execute_model = recording
    prompt = list(range(5, 25))  # 20 tokens: three chunks of at most 8
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    first = sent[0]
    assert [new.request_id for new in first.new_requests] == ["a"]
    assert first.new_requests[0].token_ids == prompt and first.new_requests[0].params.max_tokens == 6
    assert first.num_scheduled_tokens == {"a": 8}
    later = [step for step in sent[1:] if step.num_scheduled_tokens]
    assert all(not step.new_requests and step.cached_requests[0].request_id == "a" for step in later)
    blocks = list(first.new_requests[0].block_ids[0])
    for step in later:
        grown = step.cached_requests[0].new_block_ids
        if grown is not None:
            blocks.extend(grown[0])
    # 20 prompt tokens + 6 outputs (the last is never computed): 25 tokens in blocks of 4.
    assert len(blocks) == 7 and len(set(blocks)) == 7
    assert engine.kv_cache_manager.usage() == 0.0


def test_async_scheduling_gives_the_same_greedy_tokens_with_preemption_and_stops(tiny_model):
    """Asynchronous scheduling with preemptions, stop tokens and mixed lengths: identical greedy tokens."""
    import torch

    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, 49152, (length,), generator=generator).tolist() for length in (3, 9, 17, 30, 41, 5, 60, 12)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ] * 4
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(tiny_model),
            engine={
                "block_size": 4,
                "num_kv_blocks": 48,
                "max_model_len": 128,
                "max_num_batched_tokens": 32,
                "async_scheduling": async_scheduling,
            },
        )
        outputs = llm.generate(prompts, params)
        results[async_scheduling] = [output.outputs[0].token_ids for output in outputs]
        assert llm.engine.scheduler.num_preemptions > 0, "the tight cache should preempt"
        assert llm.engine.kv_cache_manager.usage() == 0.0
    assert results[True] == results[False]
    # A stop token found in the synchronous run's output ends the asynchronous run at the same place.
    stop = results[False][0][10]
    for async_scheduling in (False, True):
        llm = LLM(model=str(tiny_model), engine={"num_kv_blocks": 256, "async_scheduling": async_scheduling})
        output = llm.generate(
            [prompts[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
        )[0].outputs[0]
        assert output.token_ids == results[False][0][: results[False][0].index(stop) + 1]
        assert output.finish_reason == "stop" and output.stop_reason == stop


@pytest.mark.parametrize("contended", ["one long prompt", "16 requests"])
def test_under_kv_pressure_async_scheduling_preempts_and_recomputes_no_more_than_sync(tiny_model, contended):
    """A request admitted into the last free blocks needs one more for the token it samples: it preempted itself
    for it at once, lost its token in flight (asynchronous scheduling), came straight back and did it again,
    recomputing its chunk step after step (137 preemptions against 13 synchronous ones, 4x the tokens). Now the
    step that preempts admits nothing, a request that samples takes its next token's slot when admitted beside
    others, and a preempted request's chunk in flight stays in the prefix cache."""
    import torch

    if contended == "one long prompt":
        prompts = [list(range(1000, 1048)), list(range(2000, 2320))]
        params = [
            SamplingParams(temperature=0, max_tokens=250, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        ]
        engine = {"num_kv_blocks": 24, "block_size": 16, "max_model_len": 384, "max_num_batched_tokens": 64}
    else:
        generator = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(3, 49152, (int(length),), generator=generator).tolist()
            for length in torch.randint(5, 150, (16,), generator=generator)
        ]
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        engine = {
            "max_num_seqs": 6,
            "num_kv_blocks": 40,
            "block_size": 16,
            "max_model_len": 512,
            "max_num_batched_tokens": 256,
        }
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=str(tiny_model), engine={**engine, "async_scheduling": async_scheduling})
        executor, computed = llm.engine.core.executor, [0]
        execute = executor.execute_model

        def counted(output, execute=execute, computed=computed):
            computed[0] += sum(output.num_scheduled_tokens.values())
            return execute(output)

        executor.execute_model = counted
        tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
        runs[async_scheduling] = tokens, llm.engine.scheduler.num_preemptions, computed[0]
        assert llm.engine.scheduler.num_preemptions > 0, "the tight cache should preempt"
    (sync_tokens, sync_preemptions, sync_computed), (async_tokens, async_preemptions, async_computed) = (
        runs[False],
        runs[True],
    )
    assert async_tokens == sync_tokens
    assert async_preemptions <= sync_preemptions + 2, runs
    assert async_computed <= sync_computed * 1.1, runs


def reference_penalties(raw, prompt: list[int], history: list[int], params: SamplingParams):
    """One row's penalties, independently of the runner: HF transformers' repetition penalty over prompt and
    output so far, then OpenAI's presence and frequency penalties over the output, written out per token."""
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = raw.clone().unsqueeze(0)
    if params.repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([prompt + history]), logits)
    logits = logits[0]
    for token in set(history):
        logits[token] -= params.frequency_penalty * history.count(token) + params.presence_penalty
    return logits


def test_penalties_match_a_reference_at_every_step_with_preemption_and_chunked_prefill(tiny_model, monkeypatch):
    """Every penalized row the sampler edits, against :func:`reference_penalties` over the raw logits and the
    request's tokens before that position (as the run finally reported them), with asynchronous scheduling off
    and on: chunked prefills, and preempted requests that come back with outputs (their counts rebuilt from the
    token ids they bring, then counted on the device step after step)."""
    from collections import Counter

    import torch

    from weft.runner import sampler as sampler_module
    from weft.runner.model_runner import ModelRunner

    generator = torch.Generator().manual_seed(5)
    lengths = (3, 9, 17, 30, 41, 5, 60, 12)
    prompts = [torch.randint(3, 40, (length,), generator=generator).tolist() for length in lengths]  # repeated tokens
    kinds = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0, presence_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(temperature=0, repetition_penalty=0.7, presence_penalty=-0.3, frequency_penalty=-0.6),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=3, repetition_penalty=1.2, frequency_penalty=0.3),
    ]
    params = [msgspec.structs.replace(kinds[index % len(kinds)], max_tokens=20, ignore_eos=True) for index in range(8)]
    edits, resumed, chunked = [], set(), []
    edited_logits, execute = sampler_module.edited_logits, ModelRunner.execute

    def watched_edits(raw, requests, counts=None):
        edited = edited_logits(raw, requests, counts)
        for row, request in enumerate(requests):
            position = request.num_computed_tokens - request.num_prompt_tokens  # of the output token being sampled
            edits.append((request.request_id, position, raw[row].clone(), edited[row].clone()))
        return edited

    def watched_execute(runner, step):
        for new in step.new_requests:
            if len(new.token_ids) > new.num_prompt_tokens:
                resumed.add((new.request_id, len(new.token_ids) - new.num_prompt_tokens))
            chunked.append(step.num_scheduled_tokens[new.request_id] < len(new.token_ids) - new.num_computed_tokens)
        return execute(runner, step)

    monkeypatch.setattr(sampler_module, "edited_logits", watched_edits)
    monkeypatch.setattr(ModelRunner, "execute", watched_execute)
    results = {}
    for async_scheduling in (False, True):
        for record in (edits, resumed, chunked):
            record.clear()
        llm = LLM(
            model=str(tiny_model),
            engine={
                "block_size": 4,
                "num_kv_blocks": 48,
                "max_model_len": 128,
                "max_num_batched_tokens": 32,
                "async_scheduling": async_scheduling,
            },
        )
        outputs = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions > 0, "the tight cache should preempt"
        assert any(chunked), "the long prompts should be prefilled in chunks"
        # The engine's request id is the output's with the choice's index.
        runs = {
            f"{output.request_id}-0": (prompt, request_params, output.outputs[0].token_ids)
            for output, prompt, request_params in zip(outputs, prompts, params, strict=True)
        }
        # Seeded rows too: a draw's seed is the request's and the position's, however often it was preempted.
        results[async_scheduling] = [tokens for _, _, tokens in runs.values()]
        checked = Counter()
        for request_id, position, raw, edited in edits:
            prompt, request_params, tokens = runs[request_id]
            penalties = (
                request_params.repetition_penalty,
                request_params.presence_penalty,
                request_params.frequency_penalty,
            )
            if penalties == (1.0, 0.0, 0.0):
                assert torch.equal(edited, raw)
                continue
            torch.testing.assert_close(edited, reference_penalties(raw, prompt, tokens[:position], request_params))
            checked["rows"] += 1
            checked["changed"] += not torch.equal(edited, raw)
            checked["repeated"] += len(set(tokens[:position])) < position
            checked["resumed"] += (request_id, position) in resumed
        assert checked["rows"] >= 6 * 20 and checked["changed"] >= checked["rows"] // 2, checked
        assert checked["repeated"] and checked["resumed"], checked  # a first step after a resume with outputs
    assert results[True] == results[False]


def test_async_scheduling_gives_the_same_sampled_tokens_and_logprobs(tiny_model, monkeypatch):
    """Random draws, logprobs and edits under asynchronous scheduling: the tokens and logprobs of the synchronous
    run (every draw seeded), and only a step with a request whose sampling reads its output on the host
    (``min_tokens``) waits for the step before it; the others, penalties included, return before their tokens
    reach the host."""
    import torch

    from weft.runner.model_runner import ModelRunner
    from weft.runner.step_handles import PendingStep

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 49152, (length,), generator=generator).tolist() for length in (3, 9, 17, 30)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.01, seed=2, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, logit_bias={5: 3.0}),
    ]
    waits, handles = [], []
    resolve, execute = ModelRunner._resolve_pending, ModelRunner.execute

    def watched_resolve(runner):
        waits.append(runner._pending is not None and runner._pending.output is None)
        resolve(runner)

    def watched_execute(runner, step):
        handles.append(execute(runner, step))
        return handles[-1]

    monkeypatch.setattr(ModelRunner, "_resolve_pending", watched_resolve)
    monkeypatch.setattr(ModelRunner, "execute", watched_execute)

    def tokens_and_logprobs(outputs):
        return [
            (
                output.outputs[0].token_ids,
                [
                    {token: round(entry.logprob, 4) for token, entry in step.items()}
                    for step in output.outputs[0].logprobs or []
                ],
            )
            for output in outputs
        ]

    results = {}
    for async_scheduling in (False, True):
        llm = LLM(model=str(tiny_model), engine={"num_kv_blocks": 256, "async_scheduling": async_scheduling})
        results[async_scheduling] = tokens_and_logprobs(llm.generate(prompts, params))
    assert results[True] == results[False]
    assert [len(tokens) for tokens, _ in results[True]] == [12, 12, 9, 12]
    assert [len(logprobs) for _, logprobs in results[True]] == [12, 12, 0, 0]
    sampled = [handle for handle in handles if any(token is not None for token in handle.result().sampled_token_ids)]
    assert len(sampled) >= 2 * 12 and all(isinstance(handle, PendingStep) for handle in sampled)
    assert not any(waits)
    penalized = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=4,
        max_tokens=6,
        ignore_eos=True,
    )
    llm.generate(prompts[:2], [params[0], penalized])
    assert not any(waits)  # penalties read the counts the runner keeps on the device
    banning = SamplingParams(temperature=0.8, seed=4, max_tokens=6, min_tokens=4, stop_token_ids=[7])
    llm.generate(prompts[:2], [params[0], banning])
    assert any(waits)


def test_engine_settings_come_from_the_platform_unless_set(tiny_model):
    from weft.builtins.cpu import CpuPlatform

    defaults = CpuPlatform().engine_defaults()
    llm = LLM(model=str(tiny_model), engine={"num_kv_blocks": 64})
    engine = llm.engine.config.engine
    assert (engine.max_num_seqs, engine.max_num_batched_tokens, engine.async_scheduling) == (
        defaults.max_num_seqs,
        defaults.max_num_batched_tokens,
        defaults.async_scheduling,
    )
    assert llm.engine.scheduler.max_num_seqs == defaults.max_num_seqs
    tuned = LLM(model=str(tiny_model), engine={"num_kv_blocks": 64, "max_num_seqs": 3, "max_num_batched_tokens": 100})
    assert (tuned.engine.scheduler.max_num_seqs, tuned.engine.scheduler.max_num_batched_tokens) == (3, 100)
    # `weft config show` prints the values the engine would use.
    shown = subprocess.run(
        [sys.executable, "-m", "weft.cli", "config", "show", "--json", "--set", "engine.max_num_seqs=5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    engine_shown = msgspec.json.decode(shown.stdout)["engine"]
    assert engine_shown["max_num_seqs"] == 5
    assert engine_shown["max_num_batched_tokens"] == defaults.max_num_batched_tokens
    assert engine_shown["async_scheduling"] is defaults.async_scheduling


def test_async_scheduling_resolves_off_with_a_kv_connector_and_says_so(tmp_path, caplog):
    """The engine applies each step's connector report before scheduling the next: asked for with a connector,
    asynchronous scheduling resolves off, where ``weft config show`` prints it too, and a warning says why."""
    from weft.config import load_config
    from weft.plugins import PluginRegistry
    from weft.resolve import resolve_engine_config

    registry = PluginRegistry()
    config = load_config(
        None,
        {
            "model": str(tmp_path),
            "use": {"kv_connector": "disk"},
            "engine": {"async_scheduling": True},
            "plugins": {"disk": {"path": str(tmp_path)}},
        },
    )
    with caplog.at_level("WARNING", logger="weft.engine"):
        assert resolve_engine_config(config, registry).engine.async_scheduling is False
    assert "async_scheduling = true is not used with a KV connector (use.kv_connector = 'disk')" in caplog.text
    alone = msgspec.structs.replace(config, use=msgspec.structs.replace(config.use, kv_connector="none"))
    assert resolve_engine_config(alone, registry).engine.async_scheduling is True


def test_an_unknown_executor_is_refused(tiny_model, tmp_path):
    with pytest.raises(Exception, match="engine.distributed_executor_backend = 'nosuch': .*executor"):
        LLM(model=str(tiny_model), engine={"distributed_executor_backend": "nosuch", "num_kv_blocks": 64})
    # weft config show says so too, naming the option, before anything loads.
    (tmp_path / "weft.toml").write_text('[engine]\ndistributed_executor_backend = "nosuch"\n')
    shown = subprocess.run(
        [sys.executable, "-m", "weft.cli", "config", "show", "--config", str(tmp_path / "weft.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 1 and "engine.distributed_executor_backend = 'nosuch'" in shown.stderr, shown.stderr


def _core_pid(server_pid: int) -> int:
    """The engine core: the spawned child of the server (not multiprocessing's resource tracker)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == server_pid and b"spawn_main" in command:
            return int(entry.name)
    raise AssertionError("no engine core process found")


def test_killing_the_core_gives_503s_and_a_non_zero_exit(tiny_model):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    server, log = start_weft_serve(["--model", str(tiny_model), "--set", "engine.num_kv_blocks=512"], port, env)
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"model": tiny_model.name, "prompt": "hello", "max_tokens": 400, "ignore_eos": True}
        results: list[httpx.Response | Exception] = []

        def call(stream: bool) -> None:
            try:
                if stream:
                    with httpx.stream(
                        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
                    ) as response:
                        results.append(
                            httpx.Response(response.status_code, content="".join(response.iter_lines()).encode())
                        )
                else:
                    results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
            except Exception as error:  # noqa: BLE001 - a refused connection once the server exited is fine
                results.append(error)

        callers = [threading.Thread(target=call, args=(index % 2 == 0,)) for index in range(6)]
        for caller in callers:
            caller.start()
        time.sleep(1.0)
        core = _core_pid(server.pid)
        probes: list[tuple[str, int, str]] = []  # after the kill: /health and new requests, until the server is gone

        def probe() -> None:
            with httpx.Client(timeout=10) as http:
                while server.poll() is None:
                    try:
                        health = http.get(f"{url}/health")
                        probes.append(("health", health.status_code, health.text))
                        late = http.post(f"{url}/v1/completions", json={**body, "max_tokens": 2})
                        probes.append(("request", late.status_code, late.text))
                    except httpx.HTTPError:
                        pass  # the listener closed: the server is exiting
                    time.sleep(0.02)

        prober = threading.Thread(target=probe)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        prober.start()
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit after its engine core died:\n" + "".join(log))
        exited = time.monotonic() - killed
        for caller in callers:
            caller.join(timeout=30)
        prober.join(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert code != 0, "".join(log)
    assert exited < 5, f"the server took {exited:.1f} s to exit"
    responses = [result for result in results if isinstance(result, httpx.Response)]
    assert len(results) == 6 and responses, results
    for response in responses:
        if response.status_code == 200:  # a stream: its headers went out before the core died
            assert b"engine core process died" in response.content, response.content[-300:]
        else:
            assert response.status_code == 503 and "engine core process died" in response.json()["error"]["message"]
    assert "engine core process died" in "".join(log)
    # Once the server noticed (within its 0.2 s watch), /health answers 503 for a second until it exits, never 200
    # again; a request that arrives after the kill is a 503 naming the cause (admitted before it noticed, it fails
    # so too).
    health = [status for kind, status, _ in probes if kind == "health"]
    assert 503 in health, probes
    assert 200 not in health[health.index(503) :], health
    for kind, status, text in probes:
        if kind == "request":
            assert status == 503 and "engine core process died" in text, (status, text)


def test_core_outputs_round_trip_msgpack():
    from weft.engine.messages import CoreStats, EngineCoreOutput, FromCore, StepOutputs

    message = StepOutputs(
        [EngineCoreOutput("r", [5], None, "stop", 5, 3)],
        CoreStats(waiting=2),
        {"x": "bad"},
        {"y": "internal error: RuntimeError: boom"},
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=FromCore) == message


def test_the_core_in_its_own_process_gives_the_in_process_greedy_tokens(tiny_model, start_server):
    """Served (core in its own process, async scheduling on and off) equals offline in-process generation."""
    import torch

    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (length,), generator=generator).tolist() for length in (4, 19, 33)]
    offline = LLM(model=str(tiny_model), engine={"num_kv_blocks": 256})
    expected = [
        output.outputs[0].token_ids
        for output in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ]
    for async_scheduling in (False, True):
        server = start_server(
            model=str(tiny_model), engine={"num_kv_blocks": 256, "async_scheduling": async_scheduling}
        )
        assert server.engine.engine_settings["async_scheduling"] is async_scheduling
        body = {"model": tiny_model.name, "prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda choice: choice["index"])
        assert [choice["text"] for choice in choices] == [offline.tokenizer.decode(tokens) for tokens in expected]
        assert response.json()["usage"]["completion_tokens"] == 12 * len(prompts)
        server.stop()


def test_an_interrupted_generate_leaves_the_engine_ready_for_the_next(tiny_model):
    llm = LLM(model=str(tiny_model), engine={"num_kv_blocks": 128, "async_scheduling": True})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(10, 30)), list(range(40, 47))]
    expected = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    execute, calls = llm.engine.core.executor.execute_model, [0]

    def interrupted(step):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return execute(step)

    llm.engine.core.executor.execute_model = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    llm.engine.core.executor.execute_model = execute
    assert not llm.engine.has_unfinished and llm.engine.kv_cache_manager.usage() == 0.0
    assert [output.outputs[0].token_ids for output in llm.generate(prompts, params)] == expected


def test_a_seeded_request_draws_the_same_tokens_preempted_batched_or_alone(tiny_model):
    """A seeded request's draw of each position is seeded from its seed and the position: the same tokens
    alone with room to spare, batched with others in a cache so tight that it is preempted and resumed,
    with asynchronous scheduling on and off; two requests with different seeds draw differently."""
    import torch

    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 40, (length,), generator=generator).tolist() for length in (7, 19, 33, 12, 50, 4)]
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=24, ignore_eos=True)
        for seed in (1, 2, 3, 1, 5, 6)
    ]
    alone = LLM(model=str(tiny_model), engine={"max_model_len": 128})
    try:
        expected = [
            alone.generate([prompt], request_params)[0].outputs[0].token_ids
            for prompt, request_params in zip(prompts, params, strict=True)
        ]
    finally:
        alone.close()
    assert expected[0] != expected[3] or prompts[0] != prompts[3]
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(tiny_model),
            engine={
                "block_size": 4,
                "num_kv_blocks": 40,
                "max_model_len": 128,
                "max_num_batched_tokens": 32,
                "async_scheduling": async_scheduling,
            },
        )
        try:
            outputs = llm.generate(prompts, params)
            assert llm.engine.scheduler.num_preemptions > 0, "the tight cache should preempt"
        finally:
            llm.close()
        assert [output.outputs[0].token_ids for output in outputs] == expected, async_scheduling
