"""The engine in the caller's process: the in-process core client plus the output processor, stepped by the caller.

``LLM`` drives it: :meth:`LLMEngine.add_request`, then :meth:`LLMEngine.step`
until nothing is unfinished; each step returns the requests that advanced, with
their text so far. :meth:`LLMEngine.close` lets the KV connector finish its saves.
"""

from __future__ import annotations

from typing import Any

from weft.config import WeftConfig
from weft.contracts.mm_processor import MultimodalInputs
from weft.engine.api.frontend import Frontend
from weft.engine.api.output_processor import OutputProcessor, RequestOutputState
from weft.engine.client import InProcessClient
from weft.plugins import PluginRegistry
from weft.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: WeftConfig, registry: PluginRegistry | None = None) -> None:
        self.registry = registry or PluginRegistry()
        self.client = InProcessClient(config, self.registry)
        self.config = self.client.config
        self.frontend = Frontend(self.config, self.registry, self.client.source)
        self.tokenizer = self.frontend.tokenizer
        self.model_name = self.frontend.model_name
        self.max_model_len = self.frontend.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)

    # What tests and tools inspect (the core in this process).

    @property
    def core(self) -> Any:
        return self.client.core

    @property
    def requests(self) -> dict[str, RequestOutputState]:
        return self.outputs.requests

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def kv_cache_manager(self) -> Any:
        return self.core.scheduler.kv_cache

    @property
    def kv_connector(self) -> Any:
        """The KV connector's scheduler role (its stats), or None."""
        return self.core.scheduler.connector

    @property
    def worker(self) -> Any:
        """The in-process worker (``uniproc`` executor only)."""
        return self.core.executor.worker

    @property
    def runner(self) -> Any:
        return self.worker.runner

    # Requests.

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stream_text: bool = True,
        multimodal: MultimodalInputs | None = None,
    ) -> RequestOutputState:
        """Queue a request. ``stream_text=False``: its text is read only once it finishes (offline generation);
        ``multimodal``: its images, as :meth:`weft.engine.api.frontend.Frontend.process_images` made them."""
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        core_request = self.frontend.core_request(request_id, prompt_token_ids, params, multimodal=multimodal)
        state = self.outputs.add(request_id, core_request.prompt_token_ids, params, stream_text)
        try:
            self.client.add_requests([core_request])
        except BaseException:
            self.outputs.abort(request_id)
            raise
        return state

    def abort(self, request_id: str) -> None:
        self.outputs.abort(request_id)
        self.client.abort([request_id])

    @property
    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests) or self.client.has_unfinished

    def step(self) -> list[RequestOutputState]:
        """One engine step; returns the requests that produced a token or finished.

        A step that raises is retried once; if it raises again (or is interrupted), every request is
        aborted, so the engine serves the next ones, and the error propagates. A request the step could
        not serve alone (non-finite logits) finishes with ``finish_reason="error"``; one the core refused
        (a constraint that failed to compile) raises ValueError naming it."""
        try:
            messages = self.client.get_outputs()
        except BaseException:
            aborted = list(self.outputs.requests)
            for request_id in aborted:
                self.outputs.abort(request_id)
            self.client.abort(aborted)  # with any output of theirs the core has not reported yet
            raise
        advanced: list[RequestOutputState] = []
        for message in messages:
            step = self.outputs.apply(message)
            if step.stopped:
                self.client.abort(step.stopped)
            advanced += step.advanced
            if step.refused:
                request_id, reason = next(iter(step.refused.items()))
                raise ValueError(f"request {request_id!r}: {reason}")
        return advanced

    def close(self) -> None:
        """Let the KV connector finish its pending saves and stop the workers. Idempotent."""
        self.client.close()
