"""What every API module's handlers share: the :class:`Server` behind the routes and a few helpers.

:mod:`weft.serve.app` builds the starlette app from the handlers of each API
(:mod:`weft.serve.chat`, :mod:`weft.serve.completions`, :mod:`weft.serve.responses`,
:mod:`weft.serve.utility`); they import this module, never each other's handlers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
import urllib.parse
import uuid
from typing import Any

import msgspec
from jinja2 import TemplateError
from starlette.requests import Request
from starlette.responses import Response

from weft.config import WeftConfig
from weft.contracts.mm_processor import MultimodalInputs
from weft.contracts.structured_output import StructuredOutputsParams
from weft.engine.api.async_engine import AsyncEngine, QueueFullError, ShuttingDownError
from weft.engine.api.streams import Delta, DeltaQueue
from weft.engine.messages import GrammarStart
from weft.generation_config import load_model_sampling_defaults
from weft.plugins.selection import select_parser
from weft.resolve import options_for
from weft.sampling_params import SamplingParams
from weft.serve import fields, structured, tools
from weft.serve import protocol as p
from weft.serve.body import ClientGone, HTTPError, check_media_type, decode, read_bytes
from weft.serve.media import RequestImages, media_limits
from weft.serve.metrics import ServerMetrics

logger = logging.getLogger("weft.serve")


class Server:
    """The state behind the routes: engine, tokenizer, limits, metrics."""

    def __init__(self, engine: AsyncEngine, config: WeftConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.api_key = config.server.api_key or os.environ.get("WEFT_API_KEY") or None
        self.metrics = ServerMetrics(engine)
        engine.observer = self.metrics
        self.created = int(time.time())
        self.model_sampling_defaults = load_model_sampling_defaults(
            engine.frontend.source, config.engine.generation_config
        )
        architecture = engine.frontend.architecture()
        self.tool_parser, self.tool_parser_options = self._parser("tool_parser", config.use.tool_parser, architecture)
        self.reasoning_parser, self.reasoning_parser_options = self._parser(
            "reasoning_parser",
            config.use.reasoning_parser,
            architecture,
        )
        self.images = RequestImages(engine, media_limits(config.server))
        """Reads a request's images and expands them into its prompt."""
        # The structured-output backend's import takes seconds: done now, off the event loop.
        threading.Thread(target=self._import_structured_output_backend, daemon=True).start()

    def _parser(self, slot: str, name: str, architecture: str | None) -> tuple[Any, Any]:
        parser = select_parser(self.engine.registry, slot, name, architecture)
        if parser is None:
            return None, None
        logger.debug("%s: %s", slot, parser.name)
        return parser, options_for(self.config, slot, parser, parser.name)

    def _import_structured_output_backend(self) -> None:
        try:
            self.engine.frontend.structured_output_backend()
        except Exception:
            logger.warning("the structured-output backend cannot be loaded", exc_info=True)

    # Plumbing shared by the handlers.

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},  # RFC 9110: a 401 names the scheme it wants
            )

    async def read(self, request: Request, body_type: type[Any], endpoint: str = "") -> Any:
        """The body as ``body_type`` (``endpoint`` names the API for :mod:`weft.serve.unsupported`). Top-level
        fields no API knows are dropped (unless ``server.strict_fields``): logged, each name once per process,
        and kept in ``request.state.ignored_fields`` for the response's header."""
        check_media_type(request)
        settings = self.config.server
        data = await read_bytes(request, settings.max_body_bytes, settings.body_timeout)
        body, ignored = await self.engine.off_loop(decode, data, body_type, endpoint, settings.strict_fields)
        if ignored:
            request.state.ignored_fields = [header_safe(name) for name in ignored[:MAX_LISTED_FIELDS]]
            log_ignored_fields(ignored, endpoint)
        return body

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            shown = repr(model) if len(model) <= 200 else f"{model[:200]!r}..."
            raise HTTPError(
                404, f"model {shown} does not exist; this server serves {self.model_name!r}", "not_found_error", "model"
            )

    def check_length(self, prompt: list[int], max_tokens: int | None) -> None:
        if len(prompt) >= self.max_model_len:
            raise HTTPError(
                400,
                f"the prompt has {len(prompt)} tokens but the model's context length is {self.max_model_len}; "
                f"shorten the prompt",
                param="messages",
            )
        if max_tokens is not None and len(prompt) + max_tokens > self.max_model_len:
            raise HTTPError(
                400,
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the model's context length "
                f"of {self.max_model_len} tokens; lower max_tokens",
                param="max_tokens",
            )

    async def start(
        self,
        request: Request,
        prompts: list[list[int]],
        params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        grammar_start: GrammarStart | None = None,
        choices_field: str = "n",
        multimodal: MultimodalInputs | None = None,
    ) -> tuple[asyncio.Queue, list[str]]:
        """Submit one engine request per prompt and choice; deltas of choice ``i*n + j`` go to one queue.
        Engine request ids are the HTTP request's id and the choice's index. ``grammar_start``:
        see :meth:`weft.engine.api.frontend.Frontend.core_request`. ``choices_field``: the request field that
        set ``params.n`` (completions' ``best_of`` where it exceeds ``n``), named in errors. ``multimodal``: the
        images of the one prompt (:meth:`RequestImages.with_images <weft.serve.media.RequestImages.with_images>`)."""
        sequences = len(prompts) * params.n
        limit = min(self.config.server.max_sequences_per_request, self.engine.max_queued_requests)
        if sequences > limit:
            raise HTTPError(
                400,
                f"{choices_field} ({params.n}) times the prompts ({len(prompts)}) is {sequences} sequences; one "
                f"request may have at most {limit} (server.max_sequences_per_request, server.max_queued_requests)",
                param=choices_field,
            )
        if kv_transfer_params is not None and sequences != 1:
            raise HTTPError(
                400,
                "kv_transfer_params: a KV transfer serves one prompt and one choice; "
                f"send {choices_field} = 1 and a single prompt",
                param="kv_transfer_params",
            )
        output: asyncio.Queue = DeltaQueue()
        choices = params.choices()
        base = request_id(request)
        batch = [
            (f"{base}-{prompt_index * len(choices) + index}", prompt, choice, prompt_index * len(choices) + index)
            for prompt_index, prompt in enumerate(prompts)
            for index, choice in enumerate(choices)
        ]
        ids = [engine_request_id for engine_request_id, *_ in batch]
        try:
            await self.engine.submit(
                batch, output, kv_transfer_params, grammar_start, getattr(request.state, "arrival", None), multimodal
            )
        except BaseException as error:
            for engine_request_id in ids:
                self.engine.abort(engine_request_id)
            if isinstance(error, QueueFullError):
                raise HTTPError(
                    503, f"the server is busy ({error}); retry later", "server_error", headers={"Retry-After": "1"}
                ) from None
            if isinstance(error, ShuttingDownError):
                raise HTTPError(503, str(error), "server_error", headers={"Retry-After": "5"}) from None
            if isinstance(error, ValueError):
                raise HTTPError(400, str(error), param=field_of(error)) from None
            raise
        return output, ids

    async def collect(self, request: Request, output: asyncio.Queue, ids: list[str]) -> list[list[Delta]]:
        """Every delta of every choice, in choice order; aborts everything if the client goes away."""
        deltas: list[list[Delta]] = [[] for _ in ids]
        pending = len(ids)
        checked = time.monotonic()
        try:
            while pending:
                try:
                    delta = await asyncio.wait_for(output.get(), timeout=0.5)
                except TimeoutError:
                    delta = None
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise ClientGone
                if delta is None:
                    continue
                if delta.error:
                    raise HTTPError(delta.error_status, delta.error)
                deltas[delta.index].append(delta)
                pending -= delta.finish_reason is not None
        finally:
            for engine_request_id in ids:
                self.engine.abort(engine_request_id)
        return deltas

    def sampling_params(
        self,
        body: Any,
        max_tokens: int | None,
        logprobs: int | None,
        unset_max_tokens: int | None = None,
        constraint: StructuredOutputsParams | None = None,
        **extra: Any,
    ) -> SamplingParams:
        """The request's sampling values; one it leaves unset comes from the model's generation config
        (``engine.generation_config``), else Weft's default. ``unset_max_tokens``: the endpoint's own
        default max_tokens (None: up to the context length). ``constraint``: the output's structured-output
        constraint; ``extra``: more SamplingParams fields."""
        logit_bias = fields.logit_bias(body)
        stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
        requested = {
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "max_tokens": max_tokens,
        }
        chosen = {
            "max_tokens": unset_max_tokens,
            **self.model_sampling_defaults,
            **{field: value for field, value in requested.items() if value is not None},
        }
        try:
            return SamplingParams(
                n=getattr(body, "n", None) or 1,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                seed=body.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                min_tokens=body.min_tokens or 0,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                structured_outputs=constraint,
                logit_bias=logit_bias,
                allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
                bad_words=tuple(body.bad_words or ()),
                **chosen,
                **extra,
            )
        except ValueError as error:
            field = str(error).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise HTTPError(400, str(error).replace("SamplingParams.", ""), param=field) from None

    def chat_prompt(
        self,
        messages: list[p.ChatMessage],
        add_generation_prompt: bool,
        settings: tools.ToolSettings | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's token ids, its tools and earlier calls rendered (:func:`weft.serve.tools.chat_input`;
        call it on a worker thread: templating and encoding take time)."""
        fields.check_messages(messages, template_kwargs)
        plain = [msgspec.to_builtins(message) for message in messages]
        try:
            conversation, kwargs = tools.chat_input(
                self.tokenizer, plain, add_generation_prompt, settings, self.tool_parser, template_kwargs or {}
            )
            return self.engine.frontend.encode_chat(conversation, add_generation_prompt, **kwargs)
        except ValueError as error:
            field = field_of(error)
            raise HTTPError(400, str(error), param=field if field.startswith("messages") else "messages") from None
        except TemplateError as error:
            raise HTTPError(
                400, f"messages: the model's chat template cannot render them: {error}", param="messages"
            ) from None

    def prompt_tail(self, prompt: list[int]) -> str:
        """The end of a prompt as text: what the reasoning parser reads (whether the template opened the thinking)."""
        return self.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)

    def reply(self, prompt_tail: str, settings: tools.ToolSettings | None) -> tools.AssistantOutput:
        """How one choice's text becomes an assistant message (reasoning, content, tool calls)."""
        reasoning = tools.reasoning_parser(self.reasoning_parser, self.reasoning_parser_options, prompt_tail)
        return tools.AssistantOutput(
            reasoning,
            tools.call_parser(settings, self.tool_parser, self.tool_parser_options),
            settings is None or settings.parallel,
        )

    def grammar_start(self, prompt_tail: str, constraint: StructuredOutputsParams | None) -> GrammarStart | None:
        """Where a constraint starts when the model may reason first (it covers the answer only); None: from the
        output's first token. A prompt that did not open the reasoning leaves the output free to open it with the
        parser's start marker, where that is one token (a model that reasons has it as one; spelled in several,
        the constraint covers the whole output, which is then all answer)."""
        parser = tools.reasoning_parser(self.reasoning_parser, self.reasoning_parser_options, prompt_tail)
        if constraint is None or parser is None:
            return None
        end = tuple(self.tokenizer.encode(parser.end, add_special_tokens=False))
        if parser.reasoning_opened():
            return GrammarStart(end)
        start = self.tokenizer.encode(parser.start, add_special_tokens=False)
        return GrammarStart(end, start[0]) if len(start) == 1 else None

    def keeps_special_tokens(self, settings: tools.ToolSettings | None) -> bool:
        """Whether the output text must keep special tokens: the markers the parsers read are some."""
        return bool(
            (self.reasoning_parser is not None and self.reasoning_parser.needs_special_tokens)
            or (
                settings is not None
                and settings.choice == "auto"
                and self.tool_parser is not None
                and self.tool_parser.needs_special_tokens
            )
        )


_PROMPT_TAIL_TOKENS = 64
"""Tokens at a prompt's end a reasoning parser reads (a template opens or closes the thinking there)."""


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


MAX_LISTED_FIELDS = 32
"""Most ignored field names one response's header lists."""
MAX_LOGGED_FIELDS = 256
"""Most distinct ignored field names this process logs (a client inventing names cannot flood the log)."""
_logged_fields: set[str] = set()


def log_ignored_fields(names: list[str], endpoint: str) -> None:
    """A warning for each of ``names`` not logged before in this process (up to :data:`MAX_LOGGED_FIELDS`)."""
    for name in names:
        if name in _logged_fields or len(_logged_fields) > MAX_LOGGED_FIELDS:
            continue
        _logged_fields.add(name)
        if len(_logged_fields) > MAX_LOGGED_FIELDS:
            logger.warning("more than %d distinct unknown request fields; no more are logged", MAX_LOGGED_FIELDS)
            continue
        logger.warning(
            "request field %r is unknown to the %s API: ignored (logged once; set server.strict_fields "
            "to refuse it with a 400)",
            header_safe(name),
            endpoint,
        )


def header_safe(name: str) -> str:
    """``name`` as it may appear in a header or the log: percent-encoded outside printable ASCII, and for the comma."""
    return urllib.parse.quote(name[:100], safe="!#$&'*+-.^_`|~:;<=>?@[]{}()/ \"")


def struct_response(value: msgspec.Struct) -> Response:
    """A 200 whose JSON body is ``value``, one of :mod:`weft.serve.protocol`'s response Structs."""
    return Response(msgspec.json.encode(value), media_type="application/json")


def server_of(request: Request) -> Server:
    """The :class:`Server` behind the app that took ``request``."""
    return request.app.state.server


def request_id(request: Request) -> str:
    """The id of one HTTP request: in its ``X-Request-Id`` response header, its engine requests' ids and the log."""
    if getattr(request.state, "request_id", None) is None:
        request.state.request_id = uuid.uuid4().hex
    return request.state.request_id


async def start_constrained(
    server: Server,
    request: Request,
    prompts: list[list[int]],
    params: SamplingParams,
    field: str,
    kv_transfer_params: dict[str, Any] | None = None,
    grammar_start: GrammarStart | None = None,
    choices_field: str = "n",
    multimodal: MultimodalInputs | None = None,
) -> tuple[asyncio.Queue, list[str]]:
    """``Server.start``, a constraint the backend refuses named by the field the client used."""
    try:
        return await server.start(
            request, prompts, params, kv_transfer_params, grammar_start, choices_field, multimodal
        )
    except HTTPError as error:
        if error.status == 400 and params.structured_outputs is not None and "structured_outputs" in error.message:
            error.message, error.param = structured.name_field(error.message, field), field
        raise


def field_of(error: Exception) -> str:
    """The field a ``"field: problem"`` message names."""
    return str(error).split(":", 1)[0].split(" ", 1)[0]
