"""The runner's copy of one request: its token ids, block ids per KV-cache group and sampling parameters.

:class:`~weft.runner.model_runner.ModelRunner` creates one from a step's ``NewRequest``, moves it along with the
step's ``CachedRequest`` entries and appends the tokens it samples; the sampler, the penalties, the logits
processors and the pipeline stages read it.
"""

from __future__ import annotations

import torch

from weft.contracts.executor import NewRequest


class RequestState:
    """The runner's copy of one request."""

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "eos_token_ids",
        "generator",
        "block_ids",
        "num_computed_tokens",
        "prefix_hit",
        "state_transferred",
        "multimodal",
    )

    def __init__(self, new: NewRequest, device: torch.device) -> None:
        self.request_id = new.request_id
        self.token_ids = list(new.token_ids)
        """Known token ids; with asynchronous output the last sampled one may still be on the device."""
        self.num_prompt_tokens = new.num_prompt_tokens
        self.params = new.params
        self.eos_token_ids = frozenset(new.eos_token_ids)
        self.generator = None if new.params.seed is None else torch.Generator(device=device)
        """The request's own random draws, on the device that samples it (when it has a seed): seeded for each
        draw from the seed and the position drawn (:func:`~weft.runner.sampler.draw_seed`)."""
        self.block_ids = [list(group) for group in new.block_ids]
        self.num_computed_tokens = new.num_computed_tokens
        self.prefix_hit: int | None = None
        """Tokens found cached (locally or loaded) when its first step ran; None before that step."""
        self.state_transferred = new.state_transferred
        self.multimodal = new.multimodal
        """Its images, extras and positions (:class:`~weft.contracts.mm_processor.MultimodalInputs`); None: text."""

    def take_prefix_hit(self) -> int:
        """On the request's first step (since it was (re)scheduled): the tokens it found cached; 0 later."""
        if self.prefix_hit is not None:
            return 0
        self.prefix_hit = self.num_computed_tokens
        return 0 if self.state_transferred else self.prefix_hit

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
