"""weft.serve.media: image URLs to decoded images within limits. Images are made here with Pillow and checked
against Pillow's own decoding; http(s) URLs are fetched from a real uvicorn server in a thread."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest

pytest.importorskip("PIL")
pytest.importorskip("httpx")

from PIL import Image  # noqa: E402

from weft.serve.media import ImageLoader, MediaError, MediaLimits, image_parts  # noqa: E402

PART = "messages[0].content[1].image_url"


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    pixels = bytes((x * 7 + y * 13 + seed) % 256 for y in range(height) for x in range(width) for _ in mode)
    return Image.frombytes(mode, (width, height), pixels)


def encoded(image: Image.Image, format: str, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **save)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def load(url: str, limits: MediaLimits | None = None):
    return asyncio.run(ImageLoader(limits).load(url, PART))


def test_png_and_jpeg_data_urls_decode_as_pillow_does():
    image = picture(23, 17)
    item = load(data_url(encoded(image, "PNG")))
    assert (item.width, item.height) == (23, 17) and item.pixels == image.tobytes()
    jpeg = encoded(image, "JPEG", quality=90)
    item = load(data_url(jpeg, "image/jpeg"))
    assert item.pixels == Image.open(io.BytesIO(jpeg)).convert("RGB").tobytes()


def test_transparency_is_composited_over_white():
    image = Image.new("RGBA", (4, 2), (10, 20, 30, 0))
    image.putpixel((0, 0), (10, 20, 30, 255))
    item = load(data_url(encoded(image, "PNG")))
    assert item.pixels[:3] == bytes([10, 20, 30]) and item.pixels[3:6] == bytes([255, 255, 255])


@pytest.mark.parametrize(
    "url,message",
    [
        (data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "corrupt or truncated"),
        (data_url(b"garbage" * 20), "not an image Pillow recognises"),
        ("data:image/png;base64,not base64!", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "only image/\\* is accepted"),
        ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
    ],
)
def test_malformed_urls_and_corrupt_bytes_name_the_part(url, message):
    with pytest.raises(MediaError, match=f"^{re.escape(PART)}: .*{message}") as error:
        load(url)
    assert error.value.param == PART


def test_a_truncated_image_is_corrupt():
    png = encoded(picture(64, 64), "PNG")
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load(data_url(png[: len(png) // 2]))


def test_an_unsupported_format_is_refused_naming_it():
    with pytest.raises(MediaError, match="unsupported image format TIFF"):
        load(data_url(encoded(picture(4, 4), "TIFF"), "image/tiff"))


def test_pixel_and_byte_limits_name_the_limit():
    png = encoded(picture(40, 10), "PNG")
    with pytest.raises(MediaError, match=r"40x10 = 400 pixels, more than max_image_pixels \(399\)"):
        load(data_url(png), MediaLimits(max_image_pixels=399))
    with pytest.raises(MediaError, match=r"40x10; max_image_side is 39"):
        load(data_url(png), MediaLimits(max_image_side=39))
    with pytest.raises(MediaError, match=r"more than max_image_bytes \(100\)"):
        load(data_url(png), MediaLimits(max_image_bytes=100))
    assert load(data_url(png), MediaLimits(max_image_pixels=400, max_image_side=40)).width == 40


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width x height`` (a decompression bomb's shape)."""
    png = bytearray(encoded(picture(8, 8, "L"), "PNG"))
    png[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    png[29:33] = zlib.crc32(bytes(png[12:29])).to_bytes(4, "big")
    return bytes(png)


def test_a_decompression_bomb_is_refused_from_its_header():
    with pytest.raises(MediaError, match=r"8000x8000 = 64000000 pixels, more than max_image_pixels \(33177600\)"):
        load(data_url(png_declaring(8000, 8000)))
    with pytest.raises(MediaError, match=r"max_image_side is 16384"):
        load(data_url(png_declaring(20000, 100)))
    with pytest.raises(MediaError, match=r"larger than max_image_pixels"):  # Pillow's own ceiling
        load(data_url(png_declaring(20000, 20000)))


def test_file_urls_only_under_the_allowed_path(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    image = picture(5, 6)
    (allowed / "ok.png").write_bytes(encoded(image, "PNG"))
    (outside / "secret.png").write_bytes(encoded(image, "PNG"))
    (allowed / "link.png").symlink_to(outside / "secret.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load(f"file://{allowed}/ok.png", limits).pixels == image.tobytes()
    with pytest.raises(MediaError, match="file: URLs are refused: set allowed_local_media_path"):
        load(f"file://{allowed}/ok.png")
    for escape in (f"file://{allowed}/../private/secret.png", f"file://{allowed}/link.png"):
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load(escape, limits)


def test_the_per_prompt_limit_and_image_parts():
    messages = [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "u1"}},
                {"type": "image_url", "image_url": "u2"},
            ],
        },
    ]
    parts = image_parts(messages)
    assert parts == [("messages[1].content[1].image_url", "u1"), ("messages[1].content[2].image_url", "u2")]
    assert image_parts([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input") == [
        ("input[0].content[0].image_url", "u")
    ]
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[0\]\.image_url: expected an image URL"):
        image_parts([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    url = data_url(encoded(picture(2, 2), "PNG"))
    loader = ImageLoader(MediaLimits(limit_mm_per_prompt=2))
    assert len(asyncio.run(loader.load_all([("a", url), ("b", url)]))) == 2
    with pytest.raises(MediaError, match=r"^c: the prompt carries 3 images, more than limit_mm_per_prompt \(2\)"):
        asyncio.run(loader.load_all([("a", url), ("b", url), ("c", url)]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PNG = encoded(picture(9, 7, seed=3), "PNG")


def media_app():
    from starlette.applications import Starlette
    from starlette.responses import RedirectResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def image(request):
        return Response(PNG, media_type="image/png")

    async def big(request):  # no Content-Length: the limit must hold while streaming
        async def chunks():
            for _ in range(64):
                yield b"\0" * 4096

        return StreamingResponse(chunks(), media_type="image/png")

    async def slow(request):
        await asyncio.sleep(3)
        return Response(PNG, media_type="image/png")

    async def hop(request):
        left = int(request.path_params["left"])
        return RedirectResponse(f"/hop/{left - 1}" if left else "/image.png", status_code=302)

    async def elsewhere(request):
        port = request.url.port
        return RedirectResponse(f"http://localhost:{port}/image.png", status_code=302)

    return Starlette(
        routes=[
            Route("/image.png", image),
            Route("/big", big),
            Route("/slow", slow),
            Route("/hop/{left}", hop),
            Route("/elsewhere", elsewhere),
        ]
    )


@pytest.fixture(scope="module")
def server():
    import uvicorn

    port = free_port()
    instance = uvicorn.Server(uvicorn.Config(media_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    while not instance.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    instance.should_exit = True
    thread.join(timeout=10)


def test_http_fetch_decodes_the_image(server):
    item = load(f"{server}/image.png", MediaLimits(allowed_media_domains=["127.0.0.1"]))
    assert item.pixels == Image.open(io.BytesIO(PNG)).convert("RGB").tobytes()


def test_http_size_limit_holds_while_streaming(server):
    with pytest.raises(MediaError, match=r"more than max_image_bytes \(10000\)"):
        load(f"{server}/big", MediaLimits(max_image_bytes=10000))
    with pytest.raises(MediaError, match=rf"is {len(PNG)} bytes, more than max_image_bytes \({len(PNG) - 1}\)"):
        load(f"{server}/image.png", MediaLimits(max_image_bytes=len(PNG) - 1))  # refused from its Content-Length


def test_http_timeout(server):
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"took more than fetch_timeout_s \(0.5 s\)"):
        load(f"{server}/slow", MediaLimits(fetch_timeout_s=0.5))
    assert time.monotonic() - started < 2.5


def test_http_redirect_limit(server):
    assert load(f"{server}/hop/2", MediaLimits(max_redirects=3)).width == 9
    with pytest.raises(MediaError, match=r"more than max_redirects \(2\) redirects"):
        load(f"{server}/hop/2", MediaLimits(max_redirects=2))


def test_disallowed_domains_directly_and_through_a_redirect(server):
    with pytest.raises(MediaError, match=r"host '127.0.0.1' is not in allowed_media_domains \(localhost\)"):
        load(f"{server}/image.png", MediaLimits(allowed_media_domains=["localhost"]))
    with pytest.raises(MediaError, match=r"host 'localhost' is not in allowed_media_domains \(127.0.0.1\)"):
        load(f"{server}/elsewhere", MediaLimits(allowed_media_domains=["127.0.0.1"]))
    assert load(f"{server}/elsewhere", MediaLimits(allowed_media_domains=["127.0.0.1", "localhost"])).width == 9


def test_loading_does_not_block_the_event_loop(server):
    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        try:
            await ImageLoader(MediaLimits(fetch_timeout_s=0.6)).load(f"{server}/slow", PART)
        except MediaError:
            pass
        task.cancel()
        return ticks

    assert asyncio.run(scenario()) > 20


def test_the_module_imports_no_torch():
    code = "import sys, weft.serve.media; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
