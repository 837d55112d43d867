"""Images through ``weft serve``: a real server process on a tiny LLaVA 1.5 checkpoint, the official openai client
sending ``image_url`` parts (data: URLs, file: URLs) and Responses ``input_image`` parts; outputs checked against
transformers; bad images are 400s naming the part while other requests keep their tokens."""

from __future__ import annotations

import base64
import io
import os
import threading

import httpx
import numpy
import openai
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("weft_vision")

from PIL import Image  # noqa: E402

from conftest import free_port, start_weft_serve  # noqa: E402
from test_vision_llava import IMAGE_TOKEN, PATCHES, hf_greedy, hf_pixels, image, make_tiny_llava  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 6
MAX_PIXELS = 96 * 96
"""The server's ``max_image_pixels``: the oversized image of the tests has more."""


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, tokenizer_files):
    return make_tiny_llava(tmp_path_factory.mktemp("llava"), tokenizer_files)


@pytest.fixture(scope="module")
def hf_llava(tiny_llava):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(str(tiny_llava), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def served(tiny_llava, media):
    """``weft serve`` on the tiny LLaVA (a process of its own), file: URLs allowed under ``media``."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    settings = {
        "engine.quantization": "none",
        "engine.dtype": "float32",
        "engine.block_size": "8",
        "engine.num_kv_blocks": "512",
        "server.allowed_local_media_path": str(media),
        "server.max_image_pixels": str(MAX_PIXELS),
        "server.limit_mm_per_prompt": "2",
    }
    args = ["--model", str(tiny_llava)]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    server, log = start_weft_serve(args, port, env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
            server.kill()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def png(array: numpy.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(array: numpy.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png(array)).decode()


def expected(tiny_llava, hf_llava, text: str, images: list[numpy.ndarray]) -> list[int]:
    """transformers' greedy tokens for a user message of ``text`` (its ``<image>`` marks where the images go, as the
    chat's image parts do), the chat template rendered by transformers and each ``<image>`` expanded to its patches."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llava))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids = []
    for token in tokenizer.encode(rendered, add_special_tokens=False):
        ids += [IMAGE_TOKEN] * PATCHES if token == IMAGE_TOKEN else [token]
    assert ids.count(IMAGE_TOKEN) == PATCHES * len(images)
    return hf_greedy(hf_llava, ids, hf_pixels(tiny_llava, images), NEW_TOKENS)


def chat(client, model_name, parts: list[dict], **extra):
    return client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def decoded(tiny_llava, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llava)).decode(ids, skip_special_tokens=True)


def test_data_url_images_with_the_openai_client_equal_transformers(client, model_name, tiny_llava, hf_llava):
    """One image, two images of other sizes in one prompt, streamed and not; usage counts the image positions."""
    a, b, c = image(40, 56, 11), image(64, 48, 12), image(33, 33, 13)
    one = chat(
        client,
        model_name,
        [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(a)}}],
    )
    want = expected(tiny_llava, hf_llava, "What is this?\n\n<image>", [a])
    assert one.choices[0].message.content == decoded(tiny_llava, want)
    two_parts = [
        {"type": "image_url", "image_url": {"url": data_url(b), "detail": "auto"}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_url(c)}},
    ]
    two = chat(client, model_name, two_parts)
    want_two = expected(tiny_llava, hf_llava, "<image>\n\nand\n\n<image>", [b, c])
    assert two.choices[0].message.content == decoded(tiny_llava, want_two)
    assert two.usage.prompt_tokens > 2 * PATCHES
    stream = chat(client, model_name, two_parts, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == decoded(
        tiny_llava, want_two
    )


def test_a_repeated_image_hits_the_encoder_and_prefix_caches_in_the_metrics(client, model_name, served):
    def metric(name: str) -> float:
        for line in httpx.get(f"{served}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} is not in /metrics")

    picture = image(48, 40, 21)
    parts = [{"type": "text", "text": "Once more:"}, {"type": "image_url", "image_url": {"url": data_url(picture)}}]
    first = chat(client, model_name, parts)
    prefix_hits = metric("weft_prefix_cache_hits_total")
    second = chat(client, model_name, parts)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert metric("weft_prefix_cache_hits_total") - prefix_hits >= 2 * 8  # at least the blocks before the image's last
    # Other text before the same image: no prefix shared, the image's rows come from the encoder cache.
    queries, hits = metric("weft_encoder_cache_queries_total"), metric("weft_encoder_cache_hits_total")
    chat(client, model_name, [{"type": "text", "text": "Something else entirely, then:"}, parts[1]])
    assert metric("weft_encoder_cache_queries_total") - queries == 1
    assert metric("weft_encoder_cache_hits_total") - hits == 1


def test_file_urls_under_the_allowed_path_and_the_responses_api(client, model_name, media, tiny_llava, hf_llava):
    picture = image(36, 44, 31)
    (media / "cat.png").write_bytes(png(picture))
    want = decoded(tiny_llava, expected(tiny_llava, hf_llava, "Describe\n\n<image>", [picture]))
    parts = [
        {"type": "text", "text": "Describe"},
        {"type": "image_url", "image_url": {"url": f"file://{media}/cat.png"}},
    ]
    assert chat(client, model_name, parts).choices[0].message.content == want
    response = client.responses.create(
        model=model_name,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": data_url(picture)},
                ],
            }
        ],
        max_output_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == want


@pytest.mark.parametrize(
    ("url", "fragments"),
    [
        ("data:image/png;base64,@@not-base64@@", ["not valid base64"]),
        ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(), ["not an image"]),
        ("truncated", ["corrupt or truncated"]),
        ("data:text/plain;base64,aGVsbG8=", ["only image/*"]),
        ("ftp://example.com/cat.png", ["unsupported URL scheme", "data:, http(s): or file:"]),
        ("file:///etc/passwd", ["outside allowed_local_media_path"]),
        (None, ["max_image_pixels", str(MAX_PIXELS)]),  # an image larger than the server's pixel limit
    ],
)
def test_bad_images_are_400s_naming_the_part_while_others_keep_their_tokens(
    client, model_name, tiny_llava, hf_llava, url, fragments
):
    good_picture = image(40, 40, 41)
    good_parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": data_url(good_picture)}}]
    want = decoded(tiny_llava, expected(tiny_llava, hf_llava, "Hi\n\n<image>", [good_picture]))
    results: dict[str, str] = {}

    def good() -> None:
        stream = chat(client, model_name, good_parts, stream=True)
        results["good"] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    alongside = threading.Thread(target=good)
    alongside.start()
    if url is None:
        bad_url = data_url(image(120, 100, 42))
    elif url == "truncated":  # a PNG whose header is whole and whose pixel data stops halfway
        whole = png(image(64, 64, 43))
        bad_url = "data:image/png;base64," + base64.b64encode(whole[: len(whole) // 2]).decode()
    else:
        bad_url = url
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, model_name, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": bad_url}}])
    alongside.join(timeout=120)
    error = raised.value.body
    assert error["param"] == "messages[0].content[1].image_url", error
    assert error["message"].startswith("messages[0].content[1].image_url: "), error
    for fragment in fragments:
        assert fragment in error["message"], error
    assert results.get("good") == want


def test_more_images_than_limit_mm_per_prompt(client, model_name):
    part = {"type": "image_url", "image_url": {"url": data_url(image(32, 32, 51))}}
    with pytest.raises(
        openai.BadRequestError, match=r"carries 3 images, more than limit_mm_per_prompt \(2\)"
    ) as raised:
        chat(client, model_name, [part, part, part])
    assert raised.value.body["param"] == "messages[0].content[2].image_url"


def test_a_text_only_model_refuses_image_parts_and_keeps_serving(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": data_url(image(8, 8, 0))}}]
    with pytest.raises(openai.BadRequestError, match="reads no images: no multimodal processor") as raised:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert raised.value.body["param"] == "messages[0].content[1].image_url"
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert answer.choices[0].message.content


def test_weft_generate_image_flag(tiny_llava, hf_llava, tmp_path):
    import json
    import subprocess
    import sys

    picture = image(40, 52, 61)
    (tmp_path / "cat.png").write_bytes(png(picture))
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    command = [sys.executable, "-m", "weft.cli", "generate", "--json", "--model", str(tiny_llava)]
    command += ["--set", "engine.quantization=none", "--set", "engine.dtype=float32", "--max-tokens", str(NEW_TOKENS)]
    command += ["--temperature", "0", "--ignore-eos", "--image", str(tmp_path / "cat.png"), "Describe"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    (result,) = json.loads(run.stdout)
    # The image part comes first, then the text: "<image>\n\nDescribe".
    assert result["outputs"][0]["token_ids"] == expected(tiny_llava, hf_llava, "<image>\n\nDescribe", [picture])
    missing = subprocess.run([*command[:-3], "--image", "nowhere.png", "x"], capture_output=True, text=True, env=env)
    assert missing.returncode != 0 and "--image nowhere.png: no such file" in missing.stderr
