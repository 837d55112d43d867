"""The P/D proxy: one OpenAI-compatible endpoint in front of prefill and decode instances.

For each ``POST /v1/chat/completions`` or ``/v1/completions`` the proxy picks a prefill
and a decode instance (round robin, or the least loaded by the proxy's own count of
requests in flight) and sends two legs at once, with one transfer id:

* prefill: a copy of the body with ``max_tokens = 1`` (``max_completion_tokens`` too),
  ``stream = false`` and ``kv_transfer_params = {"do_remote_decode": true, "transfer_id": T}``;
  it runs in a background task and its answer is drained and dropped;
* decode: the body with ``kv_transfer_params = {"do_remote_prefill": true, "transfer_id": T,
  "remote_host": H, "remote_port": P}``, the prefill instance's side channel (read from its
  ``GET /kv_transfer`` by the health check).

The decode response's bytes go to the client untouched, status and content type included:
no JSON re-encoding, no SSE re-parsing (msgspec reads the request body and writes the legs'
bodies, nothing else). An answer of known length (``Content-Length``: a non-streamed completion,
computed before the instance answered) is read whole and sent as one response; a stream is relayed
chunk by chunk as it comes. The response generator's ``finally`` cancels (and awaits) the prefill
task, so it never outlives the response, a client that disconnects included; an abandoned
prefill request ends on its instance, which tells the decode instance not to wait.

Errors: the proxy's own are OpenAI-shaped. A decode status >= 500 before any byte was
forwarded is retried on another decode instance (``decode_attempts`` in all), each attempt
with a new transfer and prefill leg; the last one's status and body go to the client. Any
other upstream status is forwarded as it is. An upstream that cannot be reached, breaks
off, or sends nothing for ``leg_timeout`` (``--leg-timeout``) is a 502, anything else a 500; a
body that is not JSON is a 415 (wrong content type) or
400 (malformed). A prefill leg that fails does not fail the request: the decode instance
computes the prompt itself (a prefill instance that answered an error is asked to end the
transfer, ``POST /kv_transfer/abandon``, so the decode instance need not wait for it). Instances
that fail are left out until their ``/health`` answers again; with no prefill instance left,
requests go to decode instances alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import httpx
import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

logger = logging.getLogger("weft.proxy")

Policy = Literal["round_robin", "least_loaded"]
_FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept")
UPSTREAM_KEEPALIVE_EXPIRY = 2.0
"""Seconds the proxy keeps an idle connection to an instance for reuse: below the instances' own keep-alive
(`weft serve` and uvicorn close idle connections after 5 s). At httpx's default, also 5 s, a request sent on a
connection the instance was closing at that moment failed with a ReadError before its first byte."""

_FORWARDED_RESPONSE_HEADERS = ("content-type", "content-encoding", "retry-after")
UPSTREAM_ERRORS = (httpx.TransportError, aiohttp.ClientError, TimeoutError)
"""What a leg that cannot reach its instance, is broken off or stays silent past ``leg_timeout`` raises."""
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ProxyError(Exception):
    def __init__(self, status: int, message: str, kind: str = "server_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(error: ProxyError) -> Response:
    body = {"error": {"message": error.message, "type": error.kind, "param": None, "code": str(error.status)}}
    return Response(msgspec.json.encode(body), status_code=error.status, media_type="application/json")


class Instance:
    """One upstream server, as the proxy sees it."""

    def __init__(self, url: str, role: Literal["encode", "prefill", "decode"]) -> None:
        self.url = url.rstrip("/")
        self.role = role
        self.in_flight = 0
        self.healthy = True
        self.side_channel: tuple[str, int] | None = None
        """A prefill instance's NIXL side channel, from its ``GET /kv_transfer``."""
        self.client: httpx.AsyncClient | None = None
        """The proxy's connections to this instance (:meth:`PDProxy.start`): a pool per instance, because httpcore
        looks through every pooled connection each time a request starts or ends, and one pool for all the
        instances held the connections of all three legs of every request in flight."""
        self.session: aiohttp.ClientSession | None = None
        """The legs sent to this instance (encode, prefill, decode): aiohttp, whose HTTP parser is C. The proxy
        relays every event of every stream, and reading them through httpx (h11, pure Python) was most of its CPU
        time per request, its side legs most of the rest. ``client`` serves the rest (health, side channel,
        abandoned transfers, ``GET`` pass-through)."""

    def __repr__(self) -> str:
        return f"{self.role} instance {self.url}"


class Pool:
    """The instances of one role and the choice among the healthy ones."""

    def __init__(self, instances: Sequence[Instance], policy: Policy) -> None:
        self.instances = list(instances)
        self.policy = policy
        self._turn = 0

    def choose(self, avoid: Sequence[Instance] = ()) -> Instance | None:
        healthy = [instance for instance in self.instances if instance.healthy]
        candidates = [instance for instance in healthy if instance not in avoid] or healthy
        if not candidates:
            return None
        if self.policy == "least_loaded":
            fewest = min(instance.in_flight for instance in candidates)
            candidates = [instance for instance in candidates if instance.in_flight == fewest]
        self._turn += 1
        return candidates[self._turn % len(candidates)]


class ProxyMetrics:
    def __init__(self, proxy: PDProxy) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "weft_proxy_requests", "Requests answered, by HTTP status", ["status"], registry=self.registry
        )
        self.leg_seconds = Histogram(
            "weft_proxy_leg_seconds",
            "Per leg: prefill (whole answer), decode_first_byte, decode (whole answer)",
            ["leg"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.leg_failures = Counter(
            "weft_proxy_leg_failures",
            "Legs that failed (unreachable, broke off, silent past --leg-timeout, error status)",
            ["leg"],
            registry=self.registry,
        )
        self.decode_retries = Counter(
            "weft_proxy_decode_retries", "Decode attempts retried after a 5xx", registry=self.registry
        )
        self.forwarded_bytes = Counter(
            "weft_proxy_forwarded_bytes", "Response bytes forwarded to clients", registry=self.registry
        )
        in_flight = Gauge(
            "weft_proxy_in_flight", "Legs in flight per instance", ["role", "url"], registry=self.registry
        )
        healthy = Gauge(
            "weft_proxy_instance_healthy", "1 when the instance is in rotation", ["role", "url"], registry=self.registry
        )
        for instance in proxy.instances():
            in_flight.labels(instance.role, instance.url).set_function(lambda instance=instance: instance.in_flight)
            healthy.labels(instance.role, instance.url).set_function(lambda instance=instance: float(instance.healthy))


class PDProxy:
    """The proxy's state: the instance pools, their HTTP clients, the health check, the metrics."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        policy: Policy = "round_robin",
        decode_attempts: int = 2,
        health_interval: float = 2.0,
        leg_timeout: float = 1800.0,
    ) -> None:
        if not decode_urls:
            raise ValueError("weft proxy pd needs at least one --decode URL")
        if decode_attempts < 1:
            raise ValueError(f"decode_attempts must be at least 1, got {decode_attempts}")
        self.prefill = Pool([Instance(url, "prefill") for url in prefill_urls], policy)
        self.decode = Pool([Instance(url, "decode") for url in decode_urls], policy)
        self.decode_attempts = decode_attempts
        self.health_interval = health_interval
        self.leg_timeout = leg_timeout
        """Longest an instance may send nothing on a leg (``--leg-timeout``): aiohttp's ``sock_read`` timeout on the
        legs, httpx's read timeout on the side channel and abandoned transfers."""
        self.metrics = ProxyMetrics(self)
        self._health_task: asyncio.Task | None = None

    # Lifecycle and health.

    async def start(self) -> None:
        for instance in self.instances():
            instance.client = httpx.AsyncClient(
                timeout=httpx.Timeout(connect=10.0, read=self.leg_timeout, write=60.0, pool=None),
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=256, keepalive_expiry=UPSTREAM_KEEPALIVE_EXPIRY
                ),
            )
        for instance in self.instances():
            instance.session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=self.leg_timeout),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_EXPIRY),
                auto_decompress=False,  # the bytes go through as they came, content-encoding with them
            )
        try:
            await self.check_health()
        except BaseException:
            await self.stop()  # the lifespan never reaches stop() when start() raises: close the sessions here
            raise
        self._health_task = asyncio.create_task(self._watch_health())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for instance in self.instances():
            if instance.client is not None:
                await instance.client.aclose()
            if instance.session is not None:
                await instance.session.close()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the watcher must keep running
                logger.exception("health check failed")

    def instances(self) -> list[Instance]:
        """Every upstream instance, of every role."""
        return [*self.prefill.instances, *self.decode.instances]

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(instance) for instance in self.instances()))

    async def _check(self, instance: Instance) -> None:
        assert instance.client is not None
        try:
            healthy = (await instance.client.get(f"{instance.url}/health", timeout=5.0)).status_code == 200
            if healthy and instance.role == "prefill" and instance.side_channel is None:
                instance.side_channel = await self._side_channel(instance)
        except (httpx.HTTPError, KeyError, ValueError, TypeError, msgspec.DecodeError) as error:
            # Unreachable, or a prefill instance whose /kv_transfer answer lacks its side channel: out of rotation.
            if not isinstance(error, httpx.HTTPError):
                logger.warning("%s: its side channel could not be read: %s: %s", instance, type(error).__name__, error)
            healthy = False
        if healthy != instance.healthy:
            logger.warning("%s is %s", instance, "back in rotation" if healthy else "out of rotation")
        instance.healthy = healthy

    async def _side_channel(self, instance: Instance) -> tuple[str, int] | None:
        assert instance.client is not None
        response = await instance.client.get(f"{instance.url}/kv_transfer", timeout=5.0)
        if response.status_code != 200:
            logger.error(
                "%s has no KV transfer (GET /kv_transfer answered %d): start it with use.kv_connector = "
                "'nixl' and plugins.nixl.role = 'kv_producer'",
                instance,
                response.status_code,
            )
            return None
        info = msgspec.json.decode(response.content)
        host = info["side_channel_host"]
        if host in ("0.0.0.0", "::", ""):  # listening everywhere: reach it where its API is
            host = urlsplit(instance.url).hostname or "127.0.0.1"
        return host, int(info["side_channel_port"])

    # Requests.

    async def completion(self, request: Request) -> Response:
        try:
            response = await self._completion(request)
        except ProxyError as error:
            response = error_response(error)
        except Exception as error:  # noqa: BLE001 - the client gets a 500, the log the cause
            logger.exception("error while proxying %s", request.url.path)
            response = error_response(ProxyError(500, f"proxy error: {type(error).__name__}: {error}"))
        self.metrics.requests.labels(str(response.status_code)).inc()
        return response

    async def _completion(self, request: Request) -> Response:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise ProxyError(
                415,
                f"the body must be JSON (Content-Type: application/json); got {media_type or 'none'!r}",
                "invalid_request_error",
            )
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as error:
            raise ProxyError(400, f"malformed JSON body: {error}", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the body must be a JSON object", "invalid_request_error")
        headers = {name: request.headers[name] for name in _FORWARDED_REQUEST_HEADERS if name in request.headers}
        path = request.url.path
        tried: list[Instance] = []
        for attempt in range(1, self.decode_attempts + 1):
            decode, response, prefill_task, started = await self._send(path, body, headers, tried)
            if response.status >= 500 and attempt < self.decode_attempts:
                logger.warning("%s answered %d; retrying on another decode instance", decode, response.status)
                self.metrics.decode_retries.inc()
                self.metrics.leg_failures.labels("decode").inc()
                decode.in_flight -= 1
                response.release()
                await _settle(prefill_task)
                tried.append(decode)
                continue
            forwarded = {
                name: response.headers[name] for name in _FORWARDED_RESPONSE_HEADERS if name in response.headers
            }
            relay = _Relay(self, decode, response, prefill_task, started)
            if "content-length" in response.headers:  # a whole answer, already computed: sent in one piece
                return Response(await relay.whole(), status_code=response.status, headers=forwarded)
            return _RelayedResponse(relay, status_code=response.status, headers=forwarded)
        raise AssertionError("unreachable: the last attempt returns")

    async def _send(
        self, path: str, body: dict[str, Any], headers: dict[str, str], tried: list[Instance]
    ) -> tuple[Instance, aiohttp.ClientResponse, asyncio.Task | None, float]:
        """Start both legs of one attempt; returns once the decode instance answered with its status."""
        decode = self.decode.choose(tried)
        if decode is None:
            raise ProxyError(503, "no decode instance is healthy; retry later")
        prefill = self.prefill.choose()
        prefill_task = None
        decode_body = body
        if prefill is not None and prefill.side_channel is not None:
            transfer_id = uuid.uuid4().hex
            given = body.get("kv_transfer_params")
            given = given if isinstance(given, dict) else {}
            prefill_body = {
                **body,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {**given, "do_remote_decode": True, "transfer_id": transfer_id},
            }
            prefill_body.pop("stream_options", None)
            if "max_completion_tokens" in body:
                prefill_body["max_completion_tokens"] = 1
            host, port = prefill.side_channel
            decode_body = {
                **body,
                "kv_transfer_params": {
                    **given,
                    "do_remote_prefill": True,
                    "transfer_id": transfer_id,
                    "remote_host": host,
                    "remote_port": port,
                },
            }
            prefill_task = asyncio.create_task(self._prefill(prefill, path, prefill_body, headers, transfer_id))
        decode.in_flight += 1
        started = time.monotonic()
        try:
            assert decode.session is not None
            response = await decode.session.post(
                decode.url + path, data=msgspec.json.encode(decode_body), headers=headers
            )
        except BaseException as error:
            decode.in_flight -= 1
            await _settle(prefill_task)
            if isinstance(error, UPSTREAM_ERRORS):
                decode.healthy = False
                self.metrics.leg_failures.labels("decode").inc()
                raise ProxyError(502, f"{decode} could not be reached: {type(error).__name__}: {error}") from None
            raise
        return decode, response, prefill_task, started

    async def _prefill(
        self, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str], transfer_id: str
    ) -> None:
        refused = await self._side_leg(
            "prefill", instance, path, body, headers, "the decode instance computes the prompt"
        )
        if not refused:
            return
        # The engine may never have seen the request: end its transfer, so the decode instance does not wait for KV
        # that will not come.
        assert instance.client is not None
        try:
            await instance.client.post(
                f"{instance.url}/kv_transfer/abandon", json={"transfer_id": transfer_id}, headers=headers, timeout=5.0
            )
        except httpx.TransportError as error:
            instance.healthy = False
            logger.warning(
                "%s failed to abandon transfer %s: %s: %s", instance, transfer_id, type(error).__name__, error
            )

    async def _side_leg(
        self, leg: str, instance: Instance, path: str, body: dict[str, Any], headers: dict[str, str], fallback: str
    ) -> bool:
        """Post a leg the request survives the failure of (prefill, encode): timed and counted, a failure logged
        with ``fallback`` (who does the work instead). True when the instance answered with an error status."""
        assert instance.session is not None
        instance.in_flight += 1
        started = time.monotonic()
        try:
            # Read inside the context: a leg cancelled mid-read (the client left, the decode leg ended first)
            # releases its connection now, not when the garbage collector finds the response.
            async with instance.session.post(instance.url + path, data=msgspec.json.encode(body), headers=headers) as (
                response
            ):
                answer = await response.read()
            self.metrics.leg_seconds.labels(leg).observe(time.monotonic() - started)
            if response.status < 400:
                return False
            self.metrics.leg_failures.labels(leg).inc()
            text = answer[:200].decode(errors="replace")
            logger.warning("%s answered %d: %s (%s)", instance, response.status, text, fallback)
            return True
        except UPSTREAM_ERRORS as error:
            instance.healthy = False
            self.metrics.leg_failures.labels(leg).inc()
            logger.warning("%s failed: %s: %s (%s)", instance, type(error).__name__, error, fallback)
            return False
        finally:
            instance.in_flight -= 1

    async def passthrough(self, request: Request) -> Response:
        """``GET`` routes answered by a decode instance (``/v1/models``), bytes untouched."""
        decode = self.decode.choose()
        if decode is None:
            return error_response(ProxyError(503, "no decode instance is healthy; retry later"))
        assert decode.client is not None
        headers = {name: request.headers[name] for name in _FORWARDED_REQUEST_HEADERS if name in request.headers}
        try:
            response = await decode.client.get(decode.url + request.url.path, headers=headers, timeout=30.0)
        except httpx.TransportError as error:
            return error_response(ProxyError(502, f"{decode} could not be reached: {type(error).__name__}: {error}"))
        forwarded = {name: response.headers[name] for name in _FORWARDED_RESPONSE_HEADERS if name in response.headers}
        return Response(response.content, status_code=response.status_code, headers=forwarded)

    async def health(self, request: Request) -> Response:
        if any(instance.healthy for instance in self.decode.instances):
            return Response("ok", media_type="text/plain")
        return Response("no decode instance is healthy", status_code=503, media_type="text/plain")

    async def metrics_page(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _Relay:
    """One answered attempt: the decode response to forward, and what must end with it."""

    def __init__(
        self,
        proxy: PDProxy,
        decode: Instance,
        response: aiohttp.ClientResponse,
        prefill_task: asyncio.Task | None,
        started: float,
    ) -> None:
        self.proxy, self.decode, self.response, self.prefill_task, self.started = (
            proxy,
            decode,
            response,
            prefill_task,
            started,
        )
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The decode response's bytes as they come."""
        metrics, first = self.proxy.metrics, True
        try:
            async for chunk, _ in self.response.content.iter_chunks():  # as they come, one per HTTP chunk
                if first:
                    metrics.leg_seconds.labels("decode_first_byte").observe(time.monotonic() - self.started)
                    first = False
                metrics.forwarded_bytes.inc(len(chunk))
                yield chunk
            metrics.leg_seconds.labels("decode").observe(time.monotonic() - self.started)
        except UPSTREAM_ERRORS as error:  # the client sees the response end early
            metrics.leg_failures.labels("decode").inc()
            logger.warning("%s broke off its response: %s: %s", self.decode, type(error).__name__, error)
        finally:
            await self.close()

    async def whole(self) -> bytes:
        """The decode response's bytes at once: for an answer of known length (a non-streamed completion, which the
        instance computed before answering), a plain response costs the proxy less than relaying it chunk by chunk,
        and a client that leaves meanwhile wastes nothing upstream."""
        metrics = self.proxy.metrics
        try:
            content = await self.response.read()
        except UPSTREAM_ERRORS as error:
            metrics.leg_failures.labels("decode").inc()
            raise ProxyError(502, f"{self.decode} broke off its response: {type(error).__name__}: {error}") from None
        finally:
            await self.close()
        elapsed = time.monotonic() - self.started
        metrics.leg_seconds.labels("decode_first_byte").observe(elapsed)
        metrics.leg_seconds.labels("decode").observe(elapsed)
        metrics.forwarded_bytes.inc(len(content))
        return content

    async def close(self) -> None:
        """Close the decode response and end the prefill leg (once; also when streaming never started)."""
        if self._closed:
            return
        self._closed = True
        self.decode.in_flight -= 1
        self.response.release()  # back to the pool when it was read to the end, else closed
        await _settle(self.prefill_task)


class _RelayedResponse(StreamingResponse):
    """A streaming response that closes its relay however the response ends: a client that disconnects
    before the first byte never starts the body's generator, whose ``finally`` would not run."""

    def __init__(self, relay: _Relay, **kwargs: Any) -> None:
        super().__init__(relay.chunks(), **kwargs)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


async def _settle(task: asyncio.Task | None) -> None:
    """Cancel a prefill leg still running and wait until it is gone."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def create_app(proxy: PDProxy) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await proxy.start()
        yield
        await proxy.stop()

    routes = [
        Route("/v1/chat/completions", proxy.completion, methods=["POST"]),
        Route("/v1/completions", proxy.completion, methods=["POST"]),
        Route("/v1/models", proxy.passthrough, methods=["GET"]),
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    return app
