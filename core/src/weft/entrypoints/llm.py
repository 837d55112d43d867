"""``LLM``: offline generation in vLLM's shape.

::

    from weft import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weft.config import EngineConfig, WeftConfig, load_config
from weft.engine.api.llm_engine import LLMEngine
from weft.engine.api.output_processor import RequestOutputState
from weft.generation_config import load_model_sampling_defaults
from weft.outputs import RequestOutput
from weft.plugins import PluginRegistry
from weft.plugins.lock import verify_plugin_lock
from weft.progress import report, report_summary
from weft.sampling_params import SamplingParams

_SECTIONS = ("use", "engine", "server", "plugins")
_ENGINE_KEYS = {field for field in EngineConfig.__struct_fields__}

Prompt = str | Sequence[int] | dict[str, Any]
"""Text, token ids, or ``{"prompt": text or "prompt_token_ids": ids, "multi_modal_data": {"image": images}}``
(vLLM's shape): the text or ids hold one image placeholder (``<image>`` for LLaVA) per image, in order; an image
is a Pillow image, an ``[height, width, 3]`` uint8 array or an :class:`~weft.contracts.mm_processor.ImageItem`."""
Conversation = Sequence[dict[str, Any]]


class LLM:
    """A model loaded with the plugins ``weft.toml`` and the keyword arguments select.

    ``LLM(config="weft.toml", model=..., use={...}, engine={...}, plugins={...})``;
    engine options may also be given flat, as in vLLM (``max_num_seqs=8``).
    ``model_sampling_defaults``: the SamplingParams fields the model's generation config sets
    (``engine.generation_config``), which :meth:`get_default_sampling_params` applies.
    """

    def __init__(
        self,
        model: str | None = None,
        config: str | Path | WeftConfig | None = None,
        registry: PluginRegistry | None = None,
        **overrides: Any,
    ) -> None:
        """``registry``: the plugins to build from (default: every installed one, as discovered)."""
        self._registry = registry
        if isinstance(config, WeftConfig):
            if model is not None or overrides:
                raise TypeError("LLM(config=<WeftConfig>) takes no other arguments; apply them to the config")
            self._start(config)
            return
        merged: dict[str, Any] = {}
        if model is not None:
            merged["model"] = model
        for key, value in overrides.items():
            if key in _SECTIONS:
                merged[key] = value
            elif key in _ENGINE_KEYS:
                merged[f"engine.{key}"] = value
            else:
                raise TypeError(
                    f"LLM() got an unexpected keyword argument {key!r}; give a config section "
                    f"({', '.join(_SECTIONS)}) or an engine option ({', '.join(sorted(_ENGINE_KEYS))})"
                )
        self._start(load_config(config, merged, registry=registry))

    def _start(self, config: WeftConfig) -> None:
        started = time.monotonic()
        verify_plugin_lock(config)  # a refused plugin set is the first thing said, before any step
        report("starting the engine for %s", config.model)
        self.config = config
        self.engine = LLMEngine(config, self._registry)
        self.tokenizer = self.engine.tokenizer
        self.model_sampling_defaults = load_model_sampling_defaults(
            self.engine.frontend.source, config.engine.generation_config
        )
        report_summary({**self.engine.core.describe(), "sampling_defaults": self.model_sampling_defaults}, started)
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: the model's generation config over Weft's defaults."""
        return SamplingParams(**self.model_sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.

        ``sampling_params=None``: :meth:`get_default_sampling_params`; a SamplingParams given is used as it is.
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = self._params_for(len(prompts), sampling_params)
        encoded: list[tuple[str | None, list[int], Any]] = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                encoded.append(self._with_images(prompt))
            elif isinstance(prompt, str):
                encoded.append((prompt, self.tokenizer.encode(prompt), None))
            else:
                encoded.append((None, [int(token) for token in prompt], None))
        return self._run(encoded, params, use_tqdm)

    def _with_images(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], Any]:
        """A dict prompt (:data:`Prompt`): its text, its ids expanded by the multimodal processor, and its images."""
        import numpy

        from weft.contracts.mm_processor import ImageItem

        text = prompt.get("prompt")
        token_ids = self.tokenizer.encode(text) if text is not None else [int(t) for t in prompt["prompt_token_ids"]]
        images = (prompt.get("multi_modal_data") or {}).get("image", [])
        images = images if isinstance(images, (list, tuple)) else [images]
        items = [
            image if isinstance(image, ImageItem) else ImageItem.from_array(numpy.asarray(_rgb(image)))
            for image in images
        ]
        processed = self.engine.frontend.process_images(token_ids, items)
        return text, processed.token_ids, processed.multimodal()

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply (``sampling_params`` as in
        :meth:`generate`).

        Special-token text inside the messages is encoded as plain text unless ``server.special_tokens_in_content``
        is ``"control"`` (:meth:`weft.contracts.tokenizer.Tokenizer.encode_chat`).

        ``image_url`` parts are read as the server reads them (:mod:`weft.serve.media`, the ``[server]`` limits),
        except that ``file:`` URLs may name any file where ``server.allowed_local_media_path`` is unset: the
        caller is local."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[index]
        params = self._params_for(len(conversations), sampling_params)
        encoded = []
        for conversation in conversations:
            token_ids = self.engine.frontend.encode_chat(list(conversation), add_generation_prompt, **template_kwargs)
            images = self._chat_images(list(conversation))
            multimodal = None
            if images:
                processed = self.engine.frontend.process_images(token_ids, images)
                token_ids, multimodal = processed.token_ids, processed.multimodal()
            encoded.append((self.tokenizer.decode(token_ids, skip_special_tokens=False), token_ids, multimodal))
        return self._run(encoded, params, use_tqdm)

    def _chat_images(self, conversation: list[dict[str, Any]]) -> list[Any]:
        """The images of a conversation's ``image_url`` / ``input_image`` parts, decoded (ValueError naming the part
        when one cannot be read, or when the model reads no images)."""
        import asyncio

        import msgspec

        from weft.serve.media import ImageLoader, MediaError, image_parts, media_limits

        parts = image_parts(conversation)
        if not parts:
            return []
        if self.engine.frontend.mm_processor is None:
            raise MediaError(parts[0][0], self.engine.frontend.images_refusal)
        limits = media_limits(self.config.server)
        if not limits.allowed_local_media_path:
            limits = msgspec.structs.replace(limits, allowed_local_media_path="/")
        loading = ImageLoader(limits).load_all(parts)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread: the usual case
            return asyncio.run(loading)
        # Called from a running loop (a notebook): load on a thread of its own rather than fail.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as thread:
            return thread.submit(asyncio.run, loading).result()

    def close(self) -> None:
        """Let the KV connector finish its pending saves and disconnect (also on leaving a ``with`` block)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _params_for(
        self, count: int, sampling_params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {count} prompts but {len(params)} SamplingParams; give one, or one per prompt")
        return params

    def _run(
        self, encoded: list[tuple[str | None, list[int], Any]], params: list[SamplingParams], use_tqdm: bool | None
    ) -> list[RequestOutput]:
        """``encoded``: per prompt its text, token ids and images (:class:`MultimodalInputs` or None)."""
        engine = self.engine
        groups: list[tuple[str, str | None, list[int], list[RequestOutputState]]] = []
        try:
            for (text, token_ids, multimodal), request_params in zip(encoded, params, strict=False):
                base = str(next(self._ids))
                requests = [
                    engine.add_request(f"{base}-{index}", token_ids, choice, stream_text=False, multimodal=multimodal)
                    for index, choice in enumerate(request_params.choices())
                ]
                groups.append((base, text, token_ids, requests))
        except Exception:
            for _, _, _, requests in groups:
                for request in requests:
                    engine.abort(request.request_id)
            raise
        progress = _Progress(
            len(groups), enabled=use_tqdm if use_tqdm is not None else len(groups) > 1 and sys.stderr.isatty()
        )
        done = 0
        try:
            while engine.has_unfinished:
                engine.step()
                if not progress.enabled:
                    continue
                finished = sum(all(request.finished for request in requests) for *_, requests in groups)
                if finished != done:
                    done = finished
                    progress.update(done)
        except BaseException:
            # Leave the engine clean for the next call: nothing of this one may keep blocks.
            for request_id in list(engine.requests):
                engine.abort(request_id)
            raise
        finally:
            progress.close()
        return [
            RequestOutput(
                request_id=base,
                prompt=text,
                prompt_token_ids=token_ids,
                outputs=[request.completion(index) for index, request in enumerate(requests)],
                finished=True,
                num_cached_tokens=requests[0].num_cached_tokens,
                prompt_logprobs=requests[0].prompt_logprobs,
            )
            for base, text, token_ids, requests in groups
        ]


def _rgb(image: Any) -> Any:
    """A Pillow image as RGB (its alpha over white, as the server's loader does); anything else as it is."""
    if not hasattr(image, "convert"):
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        from PIL import Image

        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


class _Progress:
    """A one-line progress bar on stderr for multi-prompt runs."""

    def __init__(self, total: int, enabled: bool, write: Callable[[str], Any] = sys.stderr.write) -> None:
        self.total, self.enabled, self.write = total, enabled, write

    def update(self, done: int) -> None:
        if self.enabled:
            filled = int(30 * done / max(self.total, 1))
            self.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} prompts")

    def close(self) -> None:
        if self.enabled:
            self.write("\n")
