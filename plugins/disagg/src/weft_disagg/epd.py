"""The E/P/D proxy: the P/D proxy (:mod:`weft_disagg.pd`) with an encode leg in front, for vision-language models.

For each ``POST /v1/chat/completions`` the proxy first sends every image part of the messages to the encode
instances, one request per image, spread over them (round robin, or the least loaded): a copy of the body whose
messages are one user message holding that image part alone, with ``max_tokens = 1`` and ``stream = false``. An
encode instance is a ``weft serve`` of the same model with ``engine.encoder_store`` set: it encodes the image and
writes its encoder output to the store under the image's item hash (which depends on the pixels and the processor's
options, not on the prompt around them). Once every encode leg answered, the prefill and decode legs run as the
P/D proxy runs them; the prefill instance (or, with no prefill instance, E+PD, the decode instance) shares the
store, so it reads the images' encoder outputs instead of encoding them.

What it reads and writes: msgspec decodes the request body once and encodes each leg's body; the decode response's
bytes go to the client untouched, status and content type included (no JSON re-encoding, no SSE re-parsing). That
is what ``bench/epd.py`` measures against a proxy that decodes and re-encodes the response.

Failures: an encode leg that fails (an error status, an instance that cannot be reached) does not fail the request:
the instance that needs the image's encoder output and does not find it in the store encodes it itself. A malformed
image is thus answered by the decode (or prefill) instance's own 400, naming the part of the client's messages,
not the encode leg's copy. A decode 5xx before the first byte is retried as in the P/D proxy, each attempt with its
encode and prefill legs again; ``/v1/completions`` (prompts without images) skips the encode leg.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from weft_disagg.pd import Instance, PDProxy, Policy, Pool

logger = logging.getLogger("weft.proxy")

_IMAGE_PART_TYPES = ("image_url", "input_image")


def image_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The image parts of a chat body's messages, in order (anything else in the body is left alone)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    return [
        part
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES
    ]


def encode_body(body: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """The encode leg's body for one image part: the client's settings, one user message with the part alone, one
    token, not streamed; sampling and output options that could make the leg fail or cost more are dropped."""
    leg = {key: value for key, value in body.items() if key in ("model", "chat_template_kwargs")}
    return {**leg, "messages": [{"role": "user", "content": [part]}], "max_tokens": 1, "stream": False}


class EPDProxy(PDProxy):
    """:class:`PDProxy` with encode instances: the module docstring."""

    def __init__(
        self,
        encode_urls: Sequence[str],
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        policy: Policy = "round_robin",
        decode_attempts: int = 2,
        health_interval: float = 2.0,
        leg_timeout: float = 1800.0,
    ) -> None:
        if not encode_urls:
            raise ValueError("weft proxy epd needs at least one --encode URL (else use weft proxy pd)")
        self.encode = Pool([Instance(url, "encode") for url in encode_urls], policy)
        super().__init__(prefill_urls, decode_urls, policy, decode_attempts, health_interval, leg_timeout)

    def instances(self) -> list[Instance]:
        return [*self.encode.instances, *super().instances()]

    async def _send(
        self, path: str, body: dict[str, Any], headers: dict[str, str], tried: list[Instance]
    ) -> tuple[Instance, aiohttp.ClientResponse, asyncio.Task | None, float]:
        parts = image_parts(body) if path.endswith("/chat/completions") else []
        if parts:
            await asyncio.gather(*(self._encode(path, encode_body(body, part), headers) for part in parts))
        return await super()._send(path, body, headers, tried)

    async def _encode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        """One encode leg; a failure is logged and counted, and the request goes on (module docstring)."""
        instance = self.encode.choose()
        if instance is None:
            logger.warning("no encode instance is healthy; the prefill (or decode) instance encodes the images")
            return
        await self._side_leg("encode", instance, path, body, headers, "the image is encoded where it is needed")
