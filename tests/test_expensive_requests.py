"""One expensive request never stalls the others (issue 50, the adversarial sweep of ``weft serve``).

Each test measures a plain 3-token completion's latency again and again while one expensive request runs beside
it: an ambiguous grammar whose mask costs more with every token, a schema near the size limit that compiles for
seconds, prompt logprobs over an 8,000-token prompt. The plain request's p99 must stay under twice its quiet p99
plus 1 s (the issue's bound), its quiet value measured beside the expensive request's cheap twin (:func:`beside`
says why), and the expensive request is bounded: it fails with a 400 naming the setting that bounds it, or it
finishes with what it asked for.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import free_port, make_tiny_model, start_weft_serve

AMBIGUOUS = 'root ::= y\ny ::= y y | y "a" | "a" y | "a"'
"""The sweep's grammar: every string of a's parses in exponentially many ways, and xgrammar's mask for it costs
more with each token (33 ms at the 100th on SmolLM2's vocabulary, 1.9 s at the 300th)."""

BUDGET = 0.01


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files, max_position_embeddings=9000)


@pytest.fixture(scope="module")
def server(model):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    # A compile timeout a loaded machine's large schema may outlive (the bound on compiles is checked, not
    # xgrammar's speed). A fill budget a fifth of the default (0.05 s): on a CI machine running ten times the work
    # of its 2 CPUs, a step's fill takes ten times its CPU time in wall time, and the plain request waits for each.
    arguments = ["--model", str(model)]
    for setting in ("engine.structured_output_compile_timeout=10", f"engine.structured_output_fill_budget={BUDGET}"):
        arguments += ["--set", setting]
    process, log = start_weft_serve(arguments, port, env)
    url = f"http://127.0.0.1:{port}"
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    # The first constraint builds the grammar backend (the vocabulary's tables) within its compile's deadline,
    # which a loaded machine may outlive: it is built for the next one all the same.
    warm = {"model": name, "prompt": "?", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
    for _ in range(3):
        response = httpx.post(f"{url}/v1/completions", json=warm, timeout=120)
        if response.status_code == 200:
            break
        assert "engine.structured_output_compile_timeout" in response.text, response.text
    yield url, name
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    assert "Traceback" not in "".join(log), "".join(log)[-4000:]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def plain_latency(url: str, name: str) -> float:
    began = time.monotonic()
    body = {"model": name, "prompt": "Hello there", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return time.monotonic() - began


def latencies_beside(url: str, name: str, body: dict, at_least: int = 0) -> tuple[httpx.Response, list[float]]:
    """The response to ``body`` (a completion), and the plain request's latencies, one after the other, while it
    ran (and after, up to ``at_least`` of them)."""
    answer: dict[str, httpx.Response] = {}

    def other() -> None:
        answer["response"] = httpx.post(f"{url}/v1/completions", json={"model": name, **body}, timeout=300)

    thread = threading.Thread(target=other)
    thread.start()
    latencies = []
    while thread.is_alive() or len(latencies) < at_least:
        latencies.append(plain_latency(url, name))
    thread.join()
    return answer["response"], latencies


def beside(url: str, name: str, body: dict, twin: dict) -> tuple[httpx.Response, list[float], list[float]]:
    """The expensive request ``body``'s response, and the plain request's latencies beside its cheap ``twin`` (the
    same shape without the expensive part: its quiet value) and beside it. The twin, not an idle server, is the
    baseline: on a CI machine running several times the work of its CPUs any second request running beside the
    plain one doubles its latency, which is not what the bound is about."""
    twin_response, quiet = latencies_beside(url, name, twin, at_least=5)
    assert twin_response.status_code == 200, twin_response.text
    response, busy = latencies_beside(url, name, body)
    return response, quiet, busy


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def assert_within_bound(quiet: list[float], busy: list[float]) -> None:
    bound = 2 * p99(quiet) + 1
    assert busy and p99(busy) < bound, (f"p99 {p99(busy):.2f} s beside it, bound {bound:.2f} s", quiet, busy)


class BusyMatcher:
    """A matcher whose fill burns ``seconds`` of CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def fill_bitmask(self, bitmask, row: int) -> None:
        began = time.thread_time()
        while time.thread_time() - began < self.seconds:
            pass


class LoopingBackend:
    def fill_bitmasks(self, matchers, bitmask) -> None:
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)


def test_the_fill_budget_names_only_the_rows_over_it_in_cpu_time():
    from weft.engine.core.fill_budget import FillBudget

    budget = FillBudget(0.03)
    cheap = [BusyMatcher(0.012) for _ in range(4)]  # together over the budget, each under it
    assert budget.fill(LoopingBackend(), cheap, None) == []
    assert budget.fill(LoopingBackend(), cheap, None) == []  # the trigger rose: not checked row by row again
    assert budget.fill(LoopingBackend(), [*cheap, BusyMatcher(0.1)], None) == [4]
    assert budget.fill(LoopingBackend(), [BusyMatcher(0.035)], None) == [0]  # the trigger is back at the budget
    assert FillBudget(0).fill(LoopingBackend(), [BusyMatcher(0.05)], None) == []
    assert "engine.structured_output_fill_budget = 0.03 s" in budget.message()


def test_a_raised_fill_trigger_goes_back_to_the_budget(monkeypatch):
    """A batch of cheap masks raises the trigger; some fills later a single costly mask, under the raised trigger
    but over the budget, is caught again."""
    from weft.engine.core import fill_budget

    monkeypatch.setattr(fill_budget, "RAISED_FOR", 2)
    budget = fill_budget.FillBudget(0.03)
    cheap = [BusyMatcher(0.012) for _ in range(4)]
    assert budget.fill(LoopingBackend(), cheap, None) == []  # raised to about 0.1 s
    assert budget.fill(LoopingBackend(), [BusyMatcher(0.001)], None) == []
    assert budget.fill(LoopingBackend(), [BusyMatcher(0.001)], None) == []
    assert budget.fill(LoopingBackend(), [BusyMatcher(0.04)], None) == [0]


def test_an_ambiguous_grammar_fails_at_its_fill_budget_and_stalls_no_other_request(server):
    url, name = server
    before = metric(url, "weft_structured_output_fill_budget_failures_total")
    # min_tokens: its EOS is banned, so it keeps taking a's (the grammar would end at any of them).
    body = {"prompt": "aaaa", "max_tokens": 2000, "min_tokens": 2000, "structured_outputs": {"grammar": AMBIGUOUS}}
    twin = {"prompt": "aaaa", "max_tokens": 40, "min_tokens": 40, "structured_outputs": {"regex": "a{1,400}"}}
    response, quiet, busy = beside(url, name, body, twin)
    assert response.status_code == 400, response.text
    assert f"engine.structured_output_fill_budget = {BUDGET:g} s" in response.json()["error"]["message"]
    assert_within_bound(quiet, busy)
    assert metric(url, "weft_structured_output_fill_budget_failures_total") == before + 1


def test_fill_processes_end_an_ambiguous_grammar_at_its_fill_budget_and_the_others_go_on(model, one_torch_thread):
    """``engine.structured_output_fill = "process"``: the fill process times its rows against the budget as the fill
    thread does, and names the matcher over it to the core, which ends its request with the error naming the setting
    while a plain request beside it goes on to its last token; the fill process keeps no matcher of either."""
    from weft import LLM, SamplingParams
    from weft.contracts.structured_output import StructuredOutputsParams

    engine = {
        "structured_output_fill": "process",
        "structured_output_fill_budget": BUDGET,
        "max_model_len": 512,
        "num_kv_blocks": 64,
    }
    prompt = [1, 5, 9, 31]
    ambiguous = SamplingParams(
        max_tokens=400, min_tokens=400, structured_outputs=StructuredOutputsParams(grammar=AMBIGUOUS)
    )
    plain = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    with LLM(model=str(model), engine=engine) as llm:
        expensive = llm.engine.add_request("ambiguous", prompt, ambiguous)
        while not expensive.output_token_ids:  # its grammar compiled (the backend built, the fill process started)
            llm.engine.step()
        other = llm.engine.add_request("plain", prompt, plain)
        error = f"request 'ambiguous': .*engine.structured_output_fill_budget = {BUDGET:g} s"
        with pytest.raises(ValueError, match=error):
            while not other.finished:  # (without the budget, the plain request finishes first, slower each step)
                llm.engine.step()
        manager = llm.engine.core.scheduler.structured_outputs
        assert manager.fills_in_process and llm.engine.core.scheduler.fill_budget_failures == 1
        assert not other.finished and other.output_token_ids  # it ran beside the ambiguous one
        assert expensive.finished and set(expensive.text) == {"a"}  # constrained until it ended, long before its 400
        while llm.engine.has_unfinished:
            llm.engine.step()
        assert other.finished and len(other.output_token_ids) == 150
        group = manager._process.result()
        group.step([], [], [])  # carries the drops
        assert group.held() == (0, 1)  # the ambiguous grammar's matcher gone, its compiled grammar cached


def test_a_streamed_ambiguous_grammar_ends_with_an_error_event(server):
    url, name = server
    body = {
        "model": name,
        "prompt": "aaaa",
        "max_tokens": 2000,
        "min_tokens": 2000,
        "stream": True,
        "structured_outputs": {"grammar": AMBIGUOUS},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert "engine.structured_output_fill_budget" in events[-2], events[-3:]
    text = "".join(event for event in events[:-2])
    assert '"text":"a' in text  # it was constrained until then


def test_a_schema_compiling_for_seconds_stalls_no_other_request(server):
    url, name = server
    # About 100 KB: under engine.structured_output_max_bytes, seconds of compiling on 2 CPUs.
    schema = {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(3500)}}
    small = {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(3)}}
    twin = {"prompt": "{", "max_tokens": 30, "structured_outputs": {"json": small}}
    body = {"prompt": "{", "max_tokens": 3, "structured_outputs": {"json": schema}}
    response, quiet, busy = beside(url, name, body, twin)
    if response.status_code == 400:  # a loaded machine's compile may outlive the module's 10 s
        assert "engine.structured_output_compile_timeout = 10 s" in response.text
    else:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"].startswith("{")
    assert_within_bound(quiet, busy)


def test_prompt_logprobs_over_thousands_of_tokens_stall_no_other_request(server):
    """The sweep's 8,000 tokens cost the same per step as these 4,000 (engine.prompt_logprobs_chunk bounds a step's
    scoring), twice the steps, which a loaded CI machine takes a minute for."""
    url, name = server
    prompt = "apple " * 3900
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    # The twin decodes beside the plain request: a long prompt without prompt logprobs is no twin, its prefill takes
    # the step's whole budget (engine.long_prefill_token_threshold gives it what the others leave).
    response, quiet, busy = beside(url, name, body, {"prompt": "apple", "max_tokens": 40, "ignore_eos": True})
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert usage["prompt_tokens"] > 3500
    assert len(choice["prompt_logprobs"]) == usage["prompt_tokens"] and choice["prompt_logprobs"][0] is None
    assert all(len(entry) >= 2 for entry in choice["prompt_logprobs"][1:])
    assert_within_bound(quiet, busy)
