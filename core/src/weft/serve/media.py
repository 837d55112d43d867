"""Images of a request: an OpenAI ``image_url`` (or Responses ``input_image``) URL to a decoded image, within limits.

A URL is one of:

* ``data:image/<format>;base64,<data>``: decoded in place;
* ``http://`` or ``https://``: fetched with httpx, no more than :attr:`MediaLimits.max_image_bytes` bytes (the
  body is counted as it streams, whatever ``Content-Length`` says), within :attr:`MediaLimits.fetch_timeout_s`
  seconds, following at most :attr:`MediaLimits.max_redirects` redirects. Where
  :attr:`MediaLimits.allowed_media_domains` is set, the host of the URL and of every redirect must be one of them
  (exactly: ``example.com`` does not allow ``img.example.com``);
* ``file:``: refused unless :attr:`MediaLimits.allowed_local_media_path` is set and the file, resolved (``..`` and
  symlinks followed), lies under it.

The bytes are decoded with Pillow (``weft-core[vision]``): the size is checked from the header before any pixel is
decoded (:attr:`MediaLimits.max_image_pixels`, :attr:`MediaLimits.max_image_side`), then the image is converted to
RGB (transparency composited over white) as a :class:`~weft.contracts.mm_processor.ImageItem`. Anything wrong is a
:class:`MediaError` (a ValueError: the server answers 400) whose message starts with the part's path
(``messages[0].content[1].image_url``) and names the limit or the problem.

Nothing here blocks the event loop: fetching is asynchronous, reading a file and decoding run in a thread
(``asyncio.to_thread``). This module imports no torch.

:class:`RequestImages` is what the handlers call: a request's images read from its parts, then expanded into its
prompt by the engine's multimodal processor (a 400 naming the part or the field when that fails).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import unquote, urljoin, urlsplit

import msgspec

from weft.contracts.mm_processor import ImageItem, MultimodalInputs
from weft.serve.body import HTTPError

if TYPE_CHECKING:
    from weft.engine.api.async_engine import AsyncEngine

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""Pillow's names of the image formats accepted (a GIF gives its first frame)."""

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.DOTALL)


class MediaLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a request's images may be (the ``[server]`` keys of the same names: :func:`media_limits`)."""

    allowed_media_domains: Annotated[
        list[str] | None,
        msgspec.Meta(
            description="Hosts http(s) image URLs may name (and redirect to); unset: any host. Set it on a server "
            "reachable from outside: without it, clients can make the server fetch from its own "
            "network."
        ),
    ] = None
    allowed_local_media_path: Annotated[
        str, msgspec.Meta(description="A folder whose files file: image URLs may read; empty: file: URLs are refused.")
    ] = ""
    max_image_bytes: Annotated[
        int,
        msgspec.Meta(
            description="The most bytes of one encoded image (a data URL's decoded bytes, a download, a file)."
        ),
    ] = 20 << 20
    max_image_pixels: Annotated[
        int, msgspec.Meta(description="The most pixels (width x height) of one image, checked before decoding.")
    ] = 7680 * 4320
    max_image_side: Annotated[int, msgspec.Meta(description="The most pixels of either side of one image.")] = 16384
    limit_mm_per_prompt: Annotated[int, msgspec.Meta(description="The most images one prompt may carry.")] = 16
    fetch_timeout_s: Annotated[float, msgspec.Meta(description="Seconds a download may take, redirects included.")] = (
        10.0
    )
    max_redirects: Annotated[int, msgspec.Meta(description="Redirects followed for one http(s) image URL.")] = 3


def media_limits(server: Any) -> MediaLimits:
    """The limits of a ``[server]`` config section (:class:`weft.config.ServerConfig` has a key per field)."""
    return MediaLimits(**{name: getattr(server, name) for name in MediaLimits.__struct_fields__})


class MediaError(ValueError):
    """An image part that cannot be used; ``param`` is the part's path (the 400's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def image_parts(messages: Sequence[Any], field: str = "messages") -> list[tuple[str, str]]:
    """``(path, url)`` of each image part of chat messages or Responses input items, in order.

    Chat: ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a string) -> path
    ``messages[i].content[j].image_url``. Responses: ``{"type": "input_image", "image_url": ...}`` -> path
    ``input[i].content[j].image_url``.
    """
    found = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image"):
                continue
            path = f"{field}[{index}].content[{part_index}].image_url"
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise MediaError(path, "expected an image URL (a data:, http(s): or file: URL)")
            found.append((path, url))
    return found


class ImageLoader:
    """Turns image URLs into :class:`ImageItem` objects within :class:`MediaLimits` (module docstring)."""

    def __init__(self, limits: MediaLimits | None = None, client: Any = None) -> None:
        self.limits = limits if limits is not None else MediaLimits()
        self._client = client

    async def load_all(self, parts: Sequence[tuple[str, str]]) -> list[ImageItem]:
        """The images of one prompt (``(path, url)`` pairs, as :func:`image_parts` gives), loaded concurrently."""
        if len(parts) > self.limits.limit_mm_per_prompt:
            raise MediaError(
                parts[self.limits.limit_mm_per_prompt][0],
                f"the prompt carries {len(parts)} images, more than limit_mm_per_prompt "
                f"({self.limits.limit_mm_per_prompt})",
            )
        return list(await asyncio.gather(*(self.load(url, path) for path, url in parts)))

    async def load(self, url: str, param: str) -> ImageItem:
        """One image; ``param`` names its part in errors."""
        scheme = urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url(url, param)
        elif scheme in ("http", "https"):
            data = await self._fetch(url, param)
        elif scheme == "file":
            data = await asyncio.to_thread(self._read_file, url, param)
        else:
            raise MediaError(
                param, f"unsupported URL scheme {scheme or url[:20]!r}: use a data:, http(s): or file: URL"
            )
        return await asyncio.to_thread(self.decode, data, param)

    def _too_big(self, param: str, size: int | str) -> MediaError:
        return MediaError(
            param, f"the image is {size} bytes, more than max_image_bytes ({self.limits.max_image_bytes})"
        )

    def _data_url(self, url: str, param: str) -> bytes:
        match = _DATA_URL.fullmatch(url)
        if match is None:
            raise MediaError(param, "a data: URL must be data:image/<format>;base64,<data>")
        mime = (match["mime"] or "").lower()
        if not mime.startswith("image/"):
            raise MediaError(param, f"data: URL of type {mime or 'none'!r}: only image/* is accepted")
        encoded = match["data"]
        if len(encoded) * 3 // 4 > self.limits.max_image_bytes + 2:
            raise self._too_big(param, f"about {len(encoded) * 3 // 4}")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as error:
            raise MediaError(param, f"the data: URL is not valid base64 ({error})") from None
        if len(data) > self.limits.max_image_bytes:
            raise self._too_big(param, len(data))
        return data

    def _check_host(self, url: str, param: str) -> None:
        allowed = self.limits.allowed_media_domains
        host = (urlsplit(url).hostname or "").lower()
        if allowed is not None and host not in {domain.lower() for domain in allowed}:
            raise MediaError(param, f"host {host!r} is not in allowed_media_domains ({', '.join(allowed) or 'none'})")

    async def _fetch(self, url: str, param: str) -> bytes:
        import httpx

        client = self._client or httpx.AsyncClient()
        try:
            return await asyncio.wait_for(self._follow(client, url, param), self.limits.fetch_timeout_s)
        except TimeoutError:
            raise MediaError(
                param, f"fetching {url} took more than fetch_timeout_s ({self.limits.fetch_timeout_s:g} s)"
            ) from None
        except httpx.HTTPError as error:
            raise MediaError(param, f"fetching {url} failed: {error}") from None
        finally:
            if client is not self._client:
                await client.aclose()

    async def _follow(self, client: Any, url: str, param: str) -> bytes:
        # Redirects are followed here, not by httpx, so that every hop's host is checked.
        for _ in range(self.limits.max_redirects + 1):
            if urlsplit(url).scheme.lower() not in ("http", "https"):
                raise MediaError(param, f"a redirect led to {url}: only http(s) URLs are followed")
            self._check_host(url, param)
            async with client.stream("GET", url, follow_redirects=False) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(param, f"fetching {url} answered HTTP {response.status_code}")
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.limits.max_image_bytes:
                    raise self._too_big(param, int(declared))
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > self.limits.max_image_bytes:
                        raise self._too_big(param, f"more than {len(body) - 1}")
                return bytes(body)
        raise MediaError(
            param, f"fetching the image took more than max_redirects ({self.limits.max_redirects}) redirects"
        )

    def _read_file(self, url: str, param: str) -> bytes:
        root = self.limits.allowed_local_media_path
        if not root:
            raise MediaError(
                param, "file: URLs are refused: set allowed_local_media_path to a folder to allow its files"
            )
        parsed = urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(param, f"file: URL on host {parsed.netloc!r}: only local files are read")
        allowed = Path(root).resolve()
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(allowed):
            raise MediaError(param, f"{path} is outside allowed_local_media_path ({allowed})")
        if not path.is_file():
            raise MediaError(param, f"{path} is not a file")
        if path.stat().st_size > self.limits.max_image_bytes:
            raise self._too_big(param, path.stat().st_size)
        return path.read_bytes()

    def decode(self, data: bytes, param: str) -> ImageItem:
        """Decode ``data`` to RGB within the pixel limits."""
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise MediaError(
                param, f"the data is not an image Pillow recognises (supported: {', '.join(FORMATS)})"
            ) from None
        except Image.DecompressionBombError as error:  # Pillow's own ceiling, far above the default limits
            raise MediaError(
                param, f"the image is larger than max_image_pixels ({self.limits.max_image_pixels}): {error}"
            ) from None
        except Exception as error:  # a malformed header fails Pillow's parsers in many ways
            raise MediaError(param, f"the image is corrupt or truncated ({type(error).__name__}: {error})") from None
        if image.format not in FORMATS:
            raise MediaError(param, f"unsupported image format {image.format}: supported are {', '.join(FORMATS)}")
        width, height = image.size
        limits = self.limits
        if max(width, height) > limits.max_image_side:
            raise MediaError(param, f"the image is {width}x{height}; max_image_side is {limits.max_image_side}")
        if width * height > limits.max_image_pixels:
            raise MediaError(
                param,
                f"the image is {width}x{height} = {width * height} pixels, more than "
                f"max_image_pixels ({limits.max_image_pixels})",
            )
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as error:
            raise MediaError(param, f"the {image.format} image is corrupt or truncated ({error})") from None
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba)
        rgb = image.convert("RGB")
        return ImageItem(width, height, rgb.tobytes())


class RequestImages:
    """A request's images for ``engine``: loaded within ``limits`` (:class:`ImageLoader`), then expanded into its
    prompt by the engine's multimodal processor."""

    def __init__(self, engine: AsyncEngine, limits: MediaLimits) -> None:
        self.engine = engine
        self.loader = ImageLoader(limits)

    async def load(self, messages: Sequence[Any], field: str = "messages") -> list[ImageItem]:
        """The images of a request's ``image_url`` / ``input_image`` parts (chat ``messages`` or Responses ``input``
        items, as msgspec Structs or plain data: :func:`image_parts`), in order, within the ``[server]`` media
        limits; a 400 naming the part when the model reads no images or an image is unusable."""
        try:
            parts = image_parts(msgspec.to_builtins(messages), field)
            if not parts:
                return []
            if self.engine.frontend.mm_processor is None:
                raise MediaError(parts[0][0], self.engine.frontend.images_refusal)
            return await self.loader.load_all(parts)
        except MediaError as error:
            raise HTTPError(400, str(error), param=error.param) from None

    async def with_images(
        self, prompt: list[int], images: list[ImageItem], field: str = "messages"
    ) -> tuple[list[int], MultimodalInputs | None]:
        """The prompt with its image placeholders expanded (the multimodal processor, off the event loop), and what
        its images carry to the engine; the prompt as it is without images."""
        if not images:
            return prompt, None
        try:
            processed = await self.engine.off_loop(self.engine.frontend.process_images, prompt, images)
        except ValueError as error:
            raise HTTPError(400, f"{field}: {error}", param=field) from None
        return processed.token_ids, processed.multimodal()
