"""``weft proxy epd`` against fake upstreams (weft_disagg.fake_upstream on real uvicorn servers): the encode legs it
sends (one per image, the part alone), then the prefill and decode legs; byte pass-through for the four
combinations of streaming and a prefill instance; a failed encode leg does not fail the request; a decode retry
redoes the encode legs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("weft_disagg")

from test_disagg_proxy import SPLIT_CHUNKS, Upstream, free_port, legs_of  # noqa: E402
from weft_disagg.epd import encode_body, image_parts  # noqa: E402

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
OTHER_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB", "detail": "low"}}


class EPDProxy:
    def __init__(self, encode: list[str], prefill: list[str], decode: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "weft.cli", "proxy", "epd", "--encode", *encode, "--decode", *decode]
        command += ["--prefill", *prefill] if prefill else []
        command += ["--port", str(self.port), "--log-level", "warning", "--health-interval", "0.2"]
        self.process = subprocess.Popen(command, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, "the proxy exited"
            try:
                if httpx.get(f"{self.url}/metrics", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def upstreams():
    started = {
        "encode": Upstream([b'{"choices": []}']),
        "encode2": Upstream([b'{"choices": []}']),
        "prefill": Upstream([b'{"choices": []}']),
        "decode": Upstream(SPLIT_CHUNKS),
    }
    yield started
    for upstream in started.values():
        upstream.stop()


@pytest.fixture(scope="module")
def proxies(upstreams):
    encoders = [upstreams["encode"].url, upstreams["encode2"].url]
    running = {
        "epd": EPDProxy(encoders, [upstreams["prefill"].url], [upstreams["decode"].url]),
        "e+pd": EPDProxy(encoders, [], [upstreams["decode"].url]),
    }
    yield running
    for proxy in running.values():
        proxy.stop()


def chat_body(key: str, stream: bool, parts: list[dict]) -> dict:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "compare"}, *parts]},
        ],
        "max_tokens": 20,
        "temperature": 0,
        "stream": stream,
        "fake_key": key,
        # The decode leg answers once its prefill leg arrived, as a real decode instance waits for the KV: the proxy
        # ends a prefill leg still on its way when the decode answer ends.
        "fake_await_prefill": True,
    }


def encode_legs(upstreams) -> list[dict]:
    """What the encoders saw (encode legs carry no fake_key: the proxy copies only the model and the one part)."""
    return [leg for name in ("encode", "encode2") for leg in list(upstreams[name].seen)]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", ["epd", "e+pd"])
def test_bytes_pass_through_and_the_legs(proxies, upstreams, kind, stream):
    key = f"legs-{kind}-{stream}"
    for name in ("encode", "encode2"):
        upstreams[name].seen.clear()
    body = chat_body(key, stream, [IMAGE, OTHER_IMAGE])
    sent = msgspec_copy(body)
    url = proxies[kind].url
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        received = list(response.iter_raw())
    assert response.status_code == 200
    assert b"".join(received) == b"".join(SPLIT_CHUNKS)
    assert body == sent
    encodes = encode_legs(upstreams)
    assert sorted(leg["messages"][0]["content"][0]["image_url"]["url"] for leg in encodes) == [
        IMAGE["image_url"]["url"],
        OTHER_IMAGE["image_url"]["url"],
    ]
    for leg in encodes:
        assert leg["max_tokens"] == 1 and leg["stream"] is False and leg["model"] == "m"
        assert [message["role"] for message in leg["messages"]] == ["user"] and len(leg["messages"][0]["content"]) == 1
    assert len(upstreams["encode"].seen) == len(upstreams["encode2"].seen) == 1  # spread over the encoders
    (decode,) = legs_of(upstreams["decode"], key)
    assert decode["messages"] == body["messages"] and decode["max_tokens"] == 20
    prefills = legs_of(upstreams["prefill"], key)
    if kind == "epd":
        transfer = decode["kv_transfer_params"]
        assert transfer["do_remote_prefill"] is True
        deadline = time.monotonic() + 10
        while not legs_of(upstreams["prefill"], key) and time.monotonic() < deadline:
            time.sleep(0.05)
        (prefill,) = legs_of(upstreams["prefill"], key)
        assert prefill["kv_transfer_params"]["transfer_id"] == transfer["transfer_id"]
        assert prefill["messages"] == body["messages"] and prefill["max_tokens"] == 1
    else:
        assert not prefills and "kv_transfer_params" not in decode


def msgspec_copy(value):
    import msgspec

    return msgspec.json.decode(msgspec.json.encode(value))


def test_completions_and_text_only_chats_send_no_encode_leg(proxies, upstreams):
    for name in ("encode", "encode2"):
        upstreams[name].seen.clear()
    url = proxies["epd"].url
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "fake_key": "text"}
    assert httpx.post(f"{url}/v1/chat/completions", json=text, timeout=30).status_code == 200
    prompt = {"model": "m", "prompt": "hi", "max_tokens": 2, "fake_key": "text"}
    assert httpx.post(f"{url}/v1/completions", json=prompt, timeout=30).status_code == 200
    assert encode_legs(upstreams) == []


def test_an_unreachable_encoder_does_not_fail_the_request(upstreams):
    proxy = EPDProxy([f"http://127.0.0.1:{free_port()}"], [], [upstreams["decode"].url])
    try:
        body = chat_body("unreachable", False, [IMAGE])
        response = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.content == b"".join(SPLIT_CHUNKS)
        metrics = httpx.get(f"{proxy.url}/metrics").text
        assert 'weft_proxy_instance_healthy{role="encode"' in metrics
    finally:
        proxy.stop()


def test_a_decode_retry_redoes_the_encode_legs(upstreams):
    decode2 = Upstream(SPLIT_CHUNKS)
    proxy = EPDProxy([upstreams["encode"].url], [], [upstreams["decode"].url, decode2.url])
    try:
        upstreams["encode"].seen.clear()
        body = {**chat_body("epd-retry", False, [IMAGE]), "fake_status": 503, "fake_fail_times": 1}
        response = httpx.post(f"{proxy.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.content == b"".join(SPLIT_CHUNKS)
        assert len(upstreams["encode"].seen) == 2
    finally:
        proxy.stop()
        decode2.stop()


def test_encode_body_and_image_parts():
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,CC"}]},
        ],
        "logprobs": True,
        "n": 3,
        "chat_template_kwargs": {"x": 1},
    }
    parts = image_parts(body)
    assert parts == [IMAGE, body["messages"][2]["content"][0]]
    assert encode_body(body, parts[0]) == {
        "model": "m",
        "chat_template_kwargs": {"x": 1},
        "messages": [{"role": "user", "content": [IMAGE]}],
        "max_tokens": 1,
        "stream": False,
    }
    assert image_parts({"prompt": "x"}) == [] and image_parts({"messages": "x"}) == []
