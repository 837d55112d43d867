"""The engine in the caller's process: the engine core plus the output processor, stepped by the caller.

``LLM`` drives it: :meth:`LLMEngine.add_request`, then :meth:`LLMEngine.step`
until nothing is unfinished; each step returns the requests that advanced, with
their text so far. :meth:`LLMEngine.close` lets the KV connector finish its saves.
"""

from __future__ import annotations

from typing import Any

from weft.config import WeftConfig
from weft.engine.core.builder import build_engine_core
from weft.engine.api.frontend import Frontend
from weft.engine.api.output_processor import OutputProcessor, RequestOutputState
from weft.plugins import PluginRegistry
from weft.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: WeftConfig, registry: PluginRegistry | None = None) -> None:
        self.registry = registry or PluginRegistry()
        self.core = build_engine_core(config, self.registry)
        self.config = self.core.config
        self.frontend = Frontend(self.config, self.registry, self.core.source)
        self.tokenizer = self.frontend.tokenizer
        self.model_name = self.frontend.model_name
        self.max_model_len = self.frontend.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)

    # What tests and tools inspect.

    @property
    def requests(self) -> dict[str, RequestOutputState]:
        return self.outputs.requests

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def kv_cache_manager(self) -> Any:
        return self.core.kv_cache_manager

    @property
    def kv_connector(self) -> Any:
        """The KV connector's scheduler role (its stats), or None."""
        return self.core.kv_connector

    @property
    def worker(self) -> Any:
        """The in-process worker (``uniproc`` executor only)."""
        return self.core.executor.worker

    @property
    def runner(self) -> Any:
        return self.worker.runner

    # Requests.

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_text: bool = True
    ) -> RequestOutputState:
        """Queue a request. ``stream_text=False``: its text is read only once it finishes (offline generation)."""
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        core_request = self.frontend.core_request(request_id, prompt_token_ids, params)
        state = self.outputs.add(request_id, core_request.prompt_token_ids, params, stream_text)
        try:
            self.core.add_request(core_request)
        except BaseException:
            self.outputs.abort(request_id)
            raise
        return state

    def abort(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self.core.abort([request_id])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests) or self.core.scheduler.has_unfinished

    def step(self) -> list[RequestOutputState]:
        """One engine step; returns the requests that produced a token or finished.

        A step that raises is retried once; if it raises again (or is interrupted), every request is
        aborted, so the engine serves the next ones, and the error propagates. A request the step could
        not serve alone (non-finite logits) finishes with ``finish_reason="error"``."""
        try:
            produced = self.core.step_with_retry()
        except BaseException:
            self.core.reset_after_failure()
            aborted = list(self.outputs.requests)
            for request_id in aborted:
                self.outputs.abort(request_id)
            self.core.abort(aborted)  # with any output of theirs the core has not reported yet
            raise
        advanced, stopped = self.outputs.process(produced)
        if stopped:
            self.core.abort(stopped)
        refused = self.core.take_refused()
        if refused:
            for request_id in refused:
                self.outputs.abort(request_id)
            request_id, reason = next(iter(refused.items()))
            raise ValueError(f"request {request_id!r}: {reason}")
        return advanced

    def close(self) -> None:
        """Let the KV connector finish its pending saves and stop the workers. Idempotent."""
        self.core.close()
