"""The OpenAI-compatible server, on a real uvicorn server, with the official openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from weft import LLM, SamplingParams

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM(model=MODEL, quantization="none")  # as the shared server (conftest's default_server) runs it


def wait_until_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished and engine.stats.kv_cache_usage == 0.0:
            return True
        time.sleep(0.05)
    return False


def test_models(client):
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_chat(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert (
        reply.usage.prompt_tokens > 0
        and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    )


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_served_completion_equals_llm_generate(client, offline):
    prompt = "The three primary colors are"
    served = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert served.choices[0].text == expected.text
    assert served.usage.completion_tokens == len(expected.token_ids)


def test_responses_with_string_and_items(client):
    plain = client.responses.create(
        model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24
    )
    assert "Paris" in plain.output_text
    items = client.responses.create(
        model=MODEL,
        temperature=0,
        max_output_tokens=24,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is the capital of France?"}]}],
    )
    assert items.output_text == plain.output_text
    assert items.usage.input_tokens > 0 and items.usage.output_tokens > 0


def test_n_seed_stop_and_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(reply.choices) == 2 and reply.choices[0].message.content != reply.choices[1].message.content
    again = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=12,
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    for choice in reply.choices:
        content = choice.logprobs.content
        assert "".join(item.token for item in content) == choice.message.content
        assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
    assert sum(len(choice.logprobs.content) for choice in reply.choices) == reply.usage.completion_tokens
    # A prompt counts once in the usage, its cached tokens too (they were summed over the choices, above the prompt).
    for again in (False, True):
        usage = client.completions.create(
            model=MODEL,
            prompt=["The quick brown fox jumps over the lazy dog. " * 6, "Count with me: one, two, three. " * 6],
            n=3,
            max_tokens=2,
        ).usage
        assert again <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    whole = client.completions.create(model=MODEL, prompt="One, two, three, four,", temperature=0, max_tokens=20)
    stop = whole.choices[0].text[4:7]
    cut = client.completions.create(
        model=MODEL, prompt="One, two, three, four,", temperature=0, max_tokens=20, stop=[stop]
    )
    assert cut.choices[0].text == whole.choices[0].text[: whole.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_tokenize_and_detokenize(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server.url}/health").text == "ok"
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in (
        "weft_requests_total",
        "weft_prompt_tokens_total",
        "weft_generation_tokens_total",
        "weft_requests_waiting",
        "weft_requests_running",
        "weft_kv_cache_usage_ratio",
        "weft_prefix_cache_hit_rate",
        "weft_time_to_first_token_seconds_bucket",
        "weft_inter_token_latency_seconds_bucket",
    ):
        assert name in metrics, name


def test_64_concurrent_streams_complete_with_the_right_text(server, offline):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(64)]
    expected = [out.outputs[0].text for out in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))]

    long_prompt = "apple " * 7900  # about 7,900 tokens: tokenized, then prefilled in chunks by the core
    health_latencies: list[float] = []

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        done = asyncio.Event()

        async def one(prompt):
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def watch_health():
            async with httpx.AsyncClient(timeout=30) as http:
                while not done.is_set():
                    started = time.monotonic()
                    assert (await http.get(f"{server.url}/health")).status_code == 200
                    health_latencies.append(time.monotonic() - started)
                    await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_health())
        try:
            long = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0, max_tokens=1)
            *texts, long_reply = await asyncio.gather(*(one(prompt) for prompt in prompts), long)
            assert long_reply.usage.prompt_tokens > 7000
            return texts
        finally:
            done.set()
            await watcher
            await client.close()

    assert asyncio.run(run()) == expected
    # The engine core runs in its own process: HTTP answers while it prefills (bench/serve_load.py measures the p99).
    assert len(health_latencies) > 10 and max(health_latencies) < 1.0, sorted(health_latencies)[-5:]
    assert wait_until_idle(server.engine)


# Errors: OpenAI-shaped bodies, the right status, and the server keeps serving.


def post(server, path, payload=None, content=None, headers=None):
    return httpx.post(f"{server.url}{path}", json=payload, content=content, headers=headers, timeout=60)


def assert_error(response, status, *fragments):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type"}
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def test_error_cases_and_the_server_keeps_serving(server, client):
    assert_error(
        post(server, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400,
        "malformed JSON",
    )
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error = assert_error(
        post(server, "/v1/chat/completions", {**base, "temperature": "hot"}), 400, "temperature", "float"
    )
    assert error["param"] == "temperature"
    assert_error(post(server, "/v1/chat/completions", {**base, "temperature": 5}), 400, "temperature", "<= 2")
    assert_error(post(server, "/v1/chat/completions", {**base, "max_tokens": 0}), 400, "max_tokens")
    assert_error(post(server, "/v1/chat/completions", {**base, "messages": []}), 400, "messages")
    long_prompt = "hello " * 9000
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": long_prompt}), 400, "tokens", "8192")
    assert_error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}), 400, "9000", "8192"
    )
    assert_error(post(server, "/v1/chat/completions", {**base, "model": "gpt-4"}), 404, "'gpt-4' does not exist")
    assert_error(post(server, "/v1/chat/completions", {**base, "model": "/etc/passwd"}), 404, "does not exist")
    assert_error(
        post(server, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
        400,
        "audio",
    )
    # Still serving.
    assert (
        "Paris"
        in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=16,
        )
        .choices[0]
        .message.content
    )


def test_client_disconnect_aborts_and_frees_blocks(server):
    engine = server.engine
    assert wait_until_idle(engine)
    payload = {
        "model": MODEL,
        "prompt": "Write a long essay about the sea.",
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert engine.stats.kv_cache_usage > 0
    assert wait_until_idle(engine), "the aborted request kept its KV blocks"


def test_non_streaming_disconnect_aborts_and_logs_no_traceback(server):
    import logging

    engine = server.engine
    assert wait_until_idle(engine)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "weft")]
    for logger in watched:
        logger.addHandler(handler)
    try:
        payload = {"model": MODEL, "prompt": "Write a long essay.", "max_tokens": 4000, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=payload, timeout=2.0)
        assert wait_until_idle(engine, timeout=30), "the abandoned request kept running"
        time.sleep(0.5)  # the handler's end is logged, if at all, after the abort
    finally:
        for logger in watched:
            logger.removeHandler(handler)
    assert not [record for record in records if record.exc_info], [record.getMessage() for record in records]


def test_body_limit_queue_limit_and_api_key(start_server, tokenizer_files, tmp_path):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)
    small = start_server(
        model=str(folder),
        engine={"max_num_seqs": 1, "num_kv_blocks": 256},
        server={"max_body_bytes": 2000, "max_queued_requests": 1, "api_key": "s3cret"},
    )
    name = folder.name
    auth = {"authorization": "Bearer s3cret"}
    refused = post(small, "/v1/completions", {"model": name, "prompt": "hi"})
    assert_error(refused, 401, "API key")
    assert refused.headers["www-authenticate"] == "Bearer"
    # A trailing slash is a 404 like any unknown path, with the key or without: no redirect, which came before the
    # key's check with a Location built from the client's Host header.
    for headers in ({"host": "evil.example"}, {**auth, "host": "evil.example"}):
        slashed = post(small, "/v1/completions/", {"model": name, "prompt": "hi"}, headers=headers)
        assert slashed.status_code == 404 and "location" not in slashed.headers, slashed.headers
    assert_error(
        post(small, "/v1/completions", {"model": name, "prompt": "hi"}, headers={"authorization": "Bearer wrong"}), 401
    )
    assert (
        post(small, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}, headers=auth).status_code
        == 200
    )
    assert_error(post(small, "/v1/completions", {"model": name, "prompt": "x" * 5000}, headers=auth), 413, "2000")
    # One request that alone needs more sequences than the queue holds can never be admitted: 400, not 503.
    too_many = post(small, "/v1/completions", {"model": name, "prompt": "hi", "n": 2, "max_tokens": 2}, headers=auth)
    assert_error(too_many, 400, "server.max_queued_requests")
    assert too_many.json()["error"]["param"] == "n"

    async def flood():
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": name, "prompt": "hello there", "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(
                *(http.post(f"{small.url}/v1/completions", json=body, headers=auth) for _ in range(6))
            )

    statuses = [response.status_code for response in asyncio.run(flood())]
    assert 200 in statuses and 503 in statuses, statuses
    busy = next(response for response in asyncio.run(flood()) if response.status_code == 503)
    assert busy.headers["retry-after"] and "busy" in busy.json()["error"]["message"]
    assert (
        post(small, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}, headers=auth).status_code
        == 200
    )


def scripted_model(folder, tokenizer_files, text: str):
    """A one-layer Llama whose greedy continuation of its first token spells ``text`` and then EOS."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files))
    chain = tokenizer.encode(text, add_special_tokens=False) + [2]
    hidden, vocab = 64, 49152
    assert len(set(chain)) == len(chain) and len(chain) <= hidden
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    embed = torch.zeros(vocab, hidden)
    head = torch.zeros(vocab, hidden)
    for slot, (token, following) in enumerate(zip(chain, chain[1:], strict=False)):
        embed[token, slot] = 1.0
        head[following, slot] = 10.0
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(hidden)}
    prefix = "model.layers.0."
    for name, shape in {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (16, hidden),
        "mlp.up_proj.weight": (16, hidden),
        "mlp.down_proj.weight": (hidden, 16),
    }.items():
        tensors[prefix + name] = torch.zeros(shape)
    tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden)
    tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    for file in tokenizer_files.iterdir():
        shutil.copy(file, folder / file.name)
    return chain


def test_multibyte_characters_split_across_tokens_arrive_intact(start_server, tokenizer_files, tmp_path):
    text = "Say 图片🌍 ok ✓"
    chain = scripted_model(tmp_path / "scripted", tokenizer_files, text)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files))
    assert any("\ufffd" in tokenizer.decode([token]) for token in chain[1:-1]), "no token splits a character"
    running = start_server(model=str(tmp_path / "scripted"), engine={"num_kv_blocks": 64})
    payload = {"model": "scripted", "prompt": chain[:1], "max_tokens": 50, "temperature": 0, "stream": True}
    pieces = []
    with httpx.stream("POST", f"{running.url}/v1/completions", json=payload, timeout=60) as response:
        raw = b"".join(response.iter_bytes())
    for line in raw.split(b"\n\n"):
        if line.startswith(b"data: {"):
            pieces.append(json.loads(line[6:])["choices"][0]["text"])
    expected = tokenizer.decode(chain[1:-1])
    assert "".join(pieces) == expected
    assert all("\ufffd" not in piece for piece in pieces)
    assert len([piece for piece in pieces if piece]) > 3  # streamed in several chunks


def test_shutdown_drains_in_flight_requests(start_server, tokenizer_files, tmp_path):
    import threading

    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)
    running = start_server(model=str(folder), engine={"num_kv_blocks": 256}, server={"shutdown_timeout": 60})
    result = {}
    payload = {"model": folder.name, "prompt": "hello", "max_tokens": 300, "ignore_eos": True}
    caller = threading.Thread(
        target=lambda: result.setdefault(
            "response", httpx.post(f"{running.url}/v1/completions", json=payload, timeout=120)
        )
    )
    caller.start()
    deadline = time.monotonic() + 30
    while not running.engine.has_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    running.uvicorn.request_shutdown()
    caller.join(timeout=120)
    running.thread.join(timeout=120)
    response = result["response"]
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 300


def test_shutdown_gives_up_after_the_timeout(start_server, tokenizer_files, tmp_path):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny", "llama", tokenizer_files)
    running = start_server(
        model=str(folder), engine={"num_kv_blocks": 4096, "max_model_len": 512}, server={"shutdown_timeout": 1}
    )
    payload = {"model": folder.name, "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=payload, timeout=120) as response:
        next(response.iter_lines())
        started = time.monotonic()
        running.uvicorn.request_shutdown()
        running.thread.join(timeout=60)
    assert not running.thread.is_alive() and time.monotonic() - started < 30


def test_responses_streaming_events(client):
    events = list(
        client.responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=24, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert streamed == final.output_text and "Paris" in streamed
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_streaming_keeps_every_logprob_and_never_leaks_a_stop_string(client):
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40, logprobs=True)
    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=40, logprobs=True, stream=True
        )
    )
    streamed = [
        item
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    expected = whole.choices[0].logprobs.content
    # Same tokens; values equal up to float noise (the second request reuses cached prompt blocks).
    assert [item.token for item in streamed] == [item.token for item in expected]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, expected, strict=False))
    text = whole.choices[0].message.content
    stop = text[10:16]  # a stop string that spans tokens
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=40, stop=[stop], stream=True
        )
        if chunk.choices
    ]
    assert "".join(pieces) == text[: text.index(stop)]


def test_more_bad_requests_get_400_and_leave_others_alone(server, client):
    import threading

    result = {}
    innocent = threading.Thread(
        target=lambda: result.setdefault(
            "reply",
            client.completions.create(
                model=MODEL, prompt="Count to twenty:", temperature=0, max_tokens=40, extra_body={"ignore_eos": True}
            ),
        )
    )
    innocent.start()
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(
        post(server, "/v1/chat/completions", {**base, "stop_token_ids": [99999], "min_tokens": 1}),
        400,
        "stop_token_ids",
    )
    assert_error(post(server, "/v1/chat/completions", {**base, "messages": [{"role": "user"}]}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {**base, "seed": 2**64}), 400, "seed")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": [1, "a"]}), 400, "prompt")
    chat = "/v1/chat/completions"
    error = assert_error(
        post(server, chat, {**base, "messages": [{"role": "robot", "content": "x"}]}),
        400,
        "messages[0].role",
        "'robot'",
    )
    assert error["param"] == "messages[0].role"
    assert_error(
        post(server, chat, {**base, "messages": [{"role": "tool", "content": "12 C"}]}), 400, "messages[0].tool_call_id"
    )
    weather = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    assert_error(post(server, chat, {**base, "tools": [{"type": "function"}]}), 400, "tools[0].function: missing")
    assert_error(
        post(server, chat, {**base, "tools": [{"type": "function", "function": {**weather, "name": "has space!"}}]}),
        400,
        "tools[0].name",
        "'has space!'",
    )
    assert_error(
        post(server, "/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": "function"}]}),
        400,
        "tools[0].name: missing",
    )
    error = assert_error(
        post(server, chat, {**base, "logit_bias": {"5": 101}}), 400, "logit_bias['5']: 101", "[-100, 100]"
    )
    assert error["param"] == "logit_bias['5']"
    error = assert_error(httpx.get(f"{server.url}/v1/nowhere"), 404, "/v1/nowhere")
    assert error["type"] == "not_found_error"
    innocent.join()
    assert result["reply"].usage.completion_tokens == 40


def test_null_fields_mean_defaults(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "n": None,
        "stream": None,
        "logprobs": None,
        "ignore_eos": None,
        "max_tokens": 4,
        "temperature": None,
        "top_p": None,
        "seed": None,
        "stop": None,
    }
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1


def test_completion_streaming_echo_and_text_offsets(client):
    prompt = "The sky is"
    stream = list(
        client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, echo=True, stream=True)
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    whole = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, echo=True)
    assert text == whole.choices[0].text and text.startswith(prompt)
    offsets = [
        offset
        for chunk in client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=1, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for offset in chunk.choices[0].logprobs.text_offset
    ]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_an_unexpected_error_is_a_generic_500_counted_as_internal(server, monkeypatch):
    import weft.serve.completions as app

    def failures() -> float:
        for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
            if line.startswith('weft_request_failures_total{reason="internal"} '):
                return float(line.split()[-1])
        raise AssertionError("no internal failures counter")

    def broken(*args, **kwargs):
        raise RuntimeError("a secret detail")

    before = failures()
    monkeypatch.setattr(app, "_completion_choices", broken)
    monkeypatch.setattr(app, "_completion_logprobs", broken)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True, "logprobs": 1}, timeout=60
    ) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert plain.status_code == 500 and "secret" not in plain.text
    assert plain.headers["x-request-id"] in plain.json()["error"]["message"]
    assert (
        events[-1] == "data: [DONE]"
        and json.loads(events[-2][6:])["error"]["code"] == "500"
        and "secret" not in events[-2]
    )
    assert failures() == before + 2


def test_best_of_returns_the_n_candidates_with_the_highest_logprob_per_token(client, server):
    """best_of = 4, n = 2 against the same request with n = 4 (a seeded request's choices sample alike): each
    prompt's two choices are its two best of those four by mean token log-probability, best first; usage
    counts all four. Greedy candidates are alike, so a greedy best_of samples only n."""
    prompts = ["Once upon a time", "The best fruit is"]
    fields = {"model": MODEL, "prompt": prompts, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    candidates = client.completions.create(n=4, logprobs=0, **fields)
    best = client.completions.create(n=2, best_of=4, logprobs=0, **fields)
    picked = []
    for number in range(len(prompts)):
        mine = candidates.choices[4 * number : 4 * number + 4]
        ranked = sorted(
            mine,
            key=lambda choice: (
                -sum(choice.logprobs.token_logprobs) / len(choice.logprobs.token_logprobs),
                choice.index,
            ),
        )
        assert [choice.text for choice in best.choices[2 * number : 2 * number + 2]] == [
            choice.text for choice in ranked[:2]
        ]
        picked.append([choice.index - 4 * number for choice in ranked[:2]])
    assert picked != [[0, 1], [0, 1]], picked  # the ranking chose, not the order of sampling
    assert [choice.index for choice in best.choices] == [0, 1, 2, 3]
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
    plain = client.completions.create(n=1, best_of=3, echo=True, **fields)
    assert (
        len(plain.choices) == 2 and plain.choices[0].logprobs is None and plain.choices[0].text.startswith(prompts[0])
    )
    with pytest.raises(openai.BadRequestError, match=r"best_of \(2\) must be at least n \(3\)"):
        client.completions.create(n=3, best_of=2, **fields)
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(best_of=2, stream=True, **fields)
    assert len(list(client.completions.create(n=2, best_of=2, stream=True, **fields))) > 2
    greedy = client.completions.create(**{**fields, "temperature": 0, "best_of": 5})
    alone = client.completions.create(**{**fields, "temperature": 0})
    assert [choice.text for choice in greedy.choices] == [choice.text for choice in alone.choices]
    assert greedy.usage.completion_tokens == alone.usage.completion_tokens
    too_many = httpx.post(
        f"{server.url}/v1/completions", json={**fields, "prompt": ["a"] * 100, "best_of": 100}, timeout=60
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "best_of", too_many.text


def test_unknown_top_level_fields_are_ignored_and_listed_in_a_header(client, server):
    """As vLLM does: a client's vendor fields (LangChain, LiteLLM) do not break a request; the response names them.
    ``user`` is a field of OpenAI's, declared: it is no ignored field."""
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=2, user="x", extra_body={"some_vendor_field": 1}
    )
    assert chat.http_response.status_code == 200
    assert chat.headers["x-weft-ignored-fields"] == "some_vendor_field"
    assert chat.parse().choices[0].message.role == "assistant"
    text = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=2, user="x", extra_body={"some_vendor_field": 1, "other": {"a": [1]}}
    )
    assert text.http_response.status_code == 200 and text.headers["x-weft-ignored-fields"] == "some_vendor_field,other"
    assert text.parse().choices[0].finish_reason == "length"
    answer = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=16, user="x", extra_body={"some_vendor_field": 1}
    )
    assert answer.http_response.status_code == 200 and answer.headers["x-weft-ignored-fields"] == "some_vendor_field"
    assert answer.parse().status in ("completed", "incomplete")
    streamed = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True, "some_vendor_field": 1},
        timeout=60,
    )
    assert streamed.status_code == 200 and streamed.headers["x-weft-ignored-fields"] == "some_vendor_field"
    plain = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2, user="x")
    assert "x-weft-ignored-fields" not in plain.headers


def test_known_fields_of_the_wrong_type_and_unimplemented_features_are_still_400s(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"max_tokens": "lots", "zzz": 1})
    with pytest.raises(openai.BadRequestError, match="functions: Weft does not implement"):
        client.chat.completions.create(
            model=MODEL, messages=messages, extra_body={"functions": [{"name": "f", "parameters": {}}]}
        )
    with pytest.raises(
        openai.BadRequestError, match="messages\\[0\\].zzz: unknown field"
    ):  # only the top level is lenient
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi", "zzz": 1}])


def test_vllm_fields_that_change_the_output_are_refused_unless_they_ask_for_nothing(client):
    """vLLM's request fields Weft does not implement are 400s naming the field (an unknown field would be dropped,
    answering as if it were absent); their values that change nothing pass, and are no ignored field."""
    messages = [{"role": "user", "content": "Hi"}]
    for endpoint, fields in (
        (client.chat.completions, {"messages": messages}),
        (client.completions, {"prompt": "Hi"}),
    ):
        for field, value in (("use_beam_search", True), ("truncate_prompt_tokens", 8), ("priority", 1)):
            with pytest.raises(openai.BadRequestError, match=f"{field}: Weft does not implement vLLM's") as refused:
                endpoint.create(model=MODEL, max_tokens=2, **fields, extra_body={field: value})
            assert refused.value.body["param"] == field
        noop = {"use_beam_search": False, "priority": 0, "spaces_between_special_tokens": True, "cache_salt": None}
        answer = endpoint.with_raw_response.create(
            model=MODEL, max_tokens=2, **fields, extra_body={**noop, "request_id": "abc"}
        )
        assert answer.http_response.status_code == 200 and answer.headers["x-weft-ignored-fields"] == "request_id"
    with pytest.raises(openai.BadRequestError, match="continue_final_message: Weft does not implement"):
        client.chat.completions.create(model=MODEL, messages=messages, extra_body={"continue_final_message": True})


def test_include_stop_str_in_output(client):
    """The text up to the stop string, with or without it, against the same greedy text generated without one."""
    fields = {"model": MODEL, "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 24}
    free = client.completions.create(**fields).choices[0].text
    stop = free.split()[2]  # a word well inside the text
    before = free[: free.index(stop)]
    cut = client.completions.create(**fields, stop=[stop]).choices[0]
    kept = client.completions.create(**fields, stop=[stop], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert (cut.text, cut.finish_reason) == (before, "stop")
    assert (kept.text, kept.finish_reason) == (before + stop, "stop")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three fruits."}], "temperature": 0}
    free = client.chat.completions.create(**chat, max_tokens=24).choices[0].message.content
    stop = free.split()[1]
    stream = client.chat.completions.create(
        **chat, max_tokens=24, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == free[: free.index(stop)] + stop


def test_skip_special_tokens_false_keeps_them_in_the_text(client, offline):
    """Past its end-of-turn token (ignore_eos), the text with special tokens is the offline tokenizer's decoding of
    the same greedy tokens with them; the default text is its decoding without them."""
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "temperature": 0,
        "max_tokens": 24,
        "extra_body": {"ignore_eos": True},
    }
    default = client.chat.completions.create(**chat)
    kept = client.chat.completions.create(**{**chat, "extra_body": {"ignore_eos": True, "skip_special_tokens": False}})
    expected = offline.chat(chat["messages"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    tokens = expected[0].outputs[0].token_ids
    with_special = offline.tokenizer.decode(tokens, skip_special_tokens=False)
    assert "<|im_end|>" in with_special  # the answer ended before max_tokens: the test shows something
    assert kept.choices[0].message.content == with_special
    assert default.choices[0].message.content == offline.tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_rebuilt_reply_may_send_back_its_tool_calls_index(client):
    """Clients that rebuild a streamed reply from its deltas keep each tool call's ``index``."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert reply.choices[0].message.role == "assistant"


def test_an_ignored_field_is_logged_once_per_name(client, caplog):
    messages = [{"role": "user", "content": "Hi"}]
    with caplog.at_level("WARNING", logger="weft.serve"):
        for _ in range(3):
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, extra_body={"field_logged_once": 1, "also_logged_once": 2}
            )
    logged = [record.getMessage() for record in caplog.records if "unknown to the" in record.getMessage()]
    assert sum("'field_logged_once'" in line for line in logged) == 1, logged
    assert sum("'also_logged_once'" in line for line in logged) == 1, logged


def test_strict_fields_refuses_unknown_fields_where_the_default_drops_them():
    from weft.serve.body import HTTPError, decode
    from weft.serve.protocol import CompletionRequest

    data = b'{"model": "m", "prompt": "hi", "zzz": 1, "user": "u", "suffix": null}'
    body, ignored = decode(data, CompletionRequest, "completions", strict_fields=False)
    assert body.prompt == "hi" and body.user == "u" and ignored == ["zzz"]  # suffix: null is its no-op value
    with pytest.raises(HTTPError) as refused:
        decode(data, CompletionRequest, "completions", strict_fields=True)
    assert refused.value.status == 400 and refused.value.message.startswith("zzz: unknown field")


def test_a_field_name_goes_into_the_header_encoded():
    from weft.serve.server import header_safe

    assert header_safe("some_vendor_field") == "some_vendor_field"
    assert header_safe("a,b\r\nSet-Cookie: x") == "a%2Cb%0D%0ASet-Cookie: x"


def scrape_families(url: str) -> dict[str, object]:
    """``/metrics`` parsed by prometheus_client's own text parser (which rejects malformed exposition)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def sample_value(families: dict, name: str, suffix: str = "", **labels: str) -> float:
    for sample in families[name].samples:
        if sample.name == name + suffix and all(sample.labels.get(key) == value for key, value in labels.items()):
            return sample.value
    raise AssertionError(f"{name}{suffix}{labels} not in /metrics")


def test_metrics_have_prometheus_semantics(server, client):
    """Running totals are counters (``_total`` samples that never go down), gauges are gauges, histograms are
    cumulative with ``+Inf`` equal to ``_count``; the prefix-cache counters move by what an identical prompt
    must hit (whole blocks before its last token), and the latency histograms count each request once."""
    prompt = f"Metrics probe {time.time_ns()}: " + "the quick brown fox jumps over the lazy dog " * 4
    count = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()["count"]
    assert count > 33
    before = scrape_families(server.url)
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=3).usage for _ in range(2)]
    after = scrape_families(server.url)

    expected_types = {
        "weft_requests": "counter",
        "weft_prompt_tokens": "counter",
        "weft_prompt_tokens_computed": "counter",
        "weft_prefix_cache_queries": "counter",
        "weft_prefix_cache_hits": "counter",
        "weft_preemptions": "counter",
        "weft_engine_steps": "counter",
        "weft_requests_waiting": "gauge",
        "weft_kv_cache_usage_ratio": "gauge",
        "weft_request_queue_time_seconds": "histogram",
        "weft_request_prefill_time_seconds": "histogram",
        "weft_request_decode_time_seconds": "histogram",
        "weft_inter_token_latency_seconds": "histogram",
        "weft_time_to_first_token_seconds": "histogram",
    }
    for name, kind in expected_types.items():
        assert after[name].type == kind, (name, after[name].type)
    for name, family in after.items():
        if family.type == "counter":
            for sample in family.samples:
                assert sample.name in (name + "_total", name + "_created"), sample
                if sample.name.endswith("_total"):
                    previous = sample_value(before, name, "_total", **sample.labels)
                    assert sample.value >= previous, (sample, previous)
        if family.type == "histogram":
            buckets = [sample for sample in family.samples if sample.name == name + "_bucket"]
            bounds = [float(sample.labels["le"]) for sample in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == float("inf"), name
            counts = [sample.value for sample in buckets]
            assert counts == sorted(counts), name
            assert counts[-1] == sample_value(after, name, "_count"), name

    def delta(name: str, suffix: str = "_total") -> float:
        return sample_value(after, name, suffix) - sample_value(before, name, suffix)

    block_size = 16
    assert delta("weft_prefix_cache_queries") == 2 * count
    assert delta("weft_prefix_cache_hits") == (count - 1) // block_size * block_size
    assert usages[1].prompt_tokens_details.cached_tokens == (count - 1) // block_size * block_size
    assert delta("weft_prompt_tokens_computed") == 2 * count - (count - 1) // block_size * block_size
    for name in (
        "weft_request_queue_time_seconds",
        "weft_request_prefill_time_seconds",
        "weft_request_decode_time_seconds",
    ):
        assert delta(name, "_count") == 2, name
    assert delta("weft_inter_token_latency_seconds", "_count") == 2 * 2  # 3 tokens each: two gaps
    assert delta("weft_request_prefill_time_seconds", "_sum") > 0
