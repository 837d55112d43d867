"""The handles of a step the runner launched (:mod:`weft.runner.model_runner`).

:class:`PendingStep`: a step whose sampled tokens are on their way to the host (asynchronous output); the next
step reads a request's still-unknown last token from it on the device. :class:`StepTokens`: what each request
of a step gained (its accepted proposals) and every token's logprobs. :class:`AwaitingMask`: a step whose
forward ran and whose sampling waits for the engine core's grammar bitmask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from weft.contracts.executor import GrammarOutput, ModelRunnerOutput, StepHandle, TokenLogprobs
from weft.runner.logits_processors import TokenBitmask, to_device
from weft.runner.rejection_sampler import VerifiedBatch
from weft.runner.request_state import RequestState
from weft.runner.sampler import SampledBatch, SampledToken, greedy_batch, plain_greedy

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.contracts.ops import OpImplementation
    from weft.runner.graphs import MaskGraphs


PromptLogprobs = dict[str, tuple[int, list[TokenLogprobs]]]
"""Per request that asked for prompt logprobs: the position of the first prompt token scored, and each scored
token's logprobs."""

FinishStep = Callable[..., ModelRunnerOutput]
"""Takes a step's tokens into the requests' states and returns its output (``ModelRunner.finish_step``)."""


class PendingStep(StepHandle):
    """A step whose sampled tokens are being copied to the host."""

    def __init__(
        self,
        finish: FinishStep,
        states: list[RequestState],
        sampling: list[int],
        sampled: SampledBatch | VerifiedBatch,
        connector_output: ConnectorOutput | None,
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]] | None = None,
    ) -> None:
        """``sampled``: one row per entry of ``sampling``, on the device (a :class:`VerifiedBatch` where the step
        verified ``proposals``, by batch row); ``finish``: takes the tokens into the requests' states once they
        reached the host (:meth:`ModelRunner.finish_step <weft.runner.model_runner.ModelRunner.finish_step>`)."""
        self.finish = finish
        self.prompt_logprobs = prompt_logprobs
        self.states = states
        self.request_ids = [state.request_id for state in states]
        self.sampling = sampling
        """Batch rows that sampled, in the order of ``device_tokens``."""
        self.proposals = proposals or {}
        self.device_tokens = sampled.last_tokens() if isinstance(sampled, VerifiedBatch) else sampled.tokens
        """Each sampling row's newest token: what its next step reads first."""
        self.connector_output = connector_output
        # On any accelerator (CUDA, ROCm, XPU): pinned copies, and one event after them on its device.
        self.host = sampled.to_host()
        accelerated = sampled.tokens.device.type != "cpu"
        self.event = torch.Event(device=sampled.tokens.device) if accelerated else None
        if self.event is not None:
            self.event.record()
        self.output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        return self.output is not None or self.event is None or self.event.query()

    def fill_unknown(self, input_ids: torch.Tensor, states: list[RequestState], counts: list[int]) -> None:
        """Copy into ``input_ids`` (``counts`` tokens of each of ``states``, end to end) the tokens this step sampled
        that the host has not seen yet, from the device."""
        if self.output is not None:
            return
        previous = {self.request_ids[row]: index for index, row in enumerate(self.sampling)}
        positions, rows = [], []
        offset = 0
        for state, count in zip(states, counts, strict=False):
            if state.num_computed_tokens + count > len(state.token_ids):
                positions.append(offset + count - 1)
                rows.append(previous[state.request_id])
            offset += count
        if positions:
            device = input_ids.device
            source = self.device_tokens[to_device(rows, torch.long, device)]
            input_ids.index_copy_(0, to_device(positions, torch.long, device), source)

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            if self.event is not None:
                self.event.synchronize()
            tokens: list[int | None] = [None] * len(self.request_ids)
            gained = StepTokens()
            failed: dict[str, str] = {}
            host = self.host
            per_row = (
                host.verified_tokens()
                if isinstance(host, VerifiedBatch)
                else [[sampled] for sampled in host.sampled_tokens()]
            )
            for row, row_tokens in zip(self.sampling, per_row, strict=True):
                request_id = self.request_ids[row]
                if row_tokens[0].error is not None:
                    failed[request_id] = row_tokens[0].error
                    continue
                tokens[row] = row_tokens[0].token_id
                gained.add(request_id, row_tokens)
            self.output = self.finish(
                self.states,
                tokens,
                gained.logprobs,
                self.connector_output,
                failed,
                self.prompt_logprobs,
                gained,
                self.proposals,
            )
        return self.output


class StepTokens:
    """What the requests of a step gained past their first token (accepted proposals), and every token's
    logprobs, by request."""

    __slots__ = ("logprobs", "more_token_ids", "more_logprobs")

    def __init__(self) -> None:
        self.logprobs: dict[str, TokenLogprobs] = {}
        self.more_token_ids: dict[str, list[int]] = {}
        self.more_logprobs: dict[str, list[TokenLogprobs]] = {}

    def add(self, request_id: str, tokens: list[SampledToken]) -> None:
        """A request's tokens of the step, the first being its ``sampled_token_ids`` entry."""
        if len(tokens) > 1:
            self.more_token_ids[request_id] = [token.token_id for token in tokens[1:]]
        if tokens[0].logprob is not None:
            entries = [TokenLogprobs(t.logprob, t.rank, t.top_logprobs or []) for t in tokens]  # type: ignore[arg-type]
            self.logprobs[request_id] = entries[0]
            if len(entries) > 1:
                self.more_logprobs[request_id] = entries[1:]


class AwaitingMask:
    """A step whose forward ran and whose sampling waits for the grammar bitmask."""

    def __init__(
        self,
        states: list[RequestState],
        sampling: list[int],
        logits: torch.Tensor | None,
        report: ConnectorOutput | None,
        prompt_logprobs: PromptLogprobs,
        graph_size: int | None,
        proposals: dict[int, list[int]],
    ) -> None:
        self.states, self.sampling, self.logits, self.report = states, sampling, logits, report
        self.prompt_logprobs = prompt_logprobs
        self.graph_size = graph_size
        """The decode graph the forward replayed (its logits are that graph's output); None: it ran eagerly."""
        self.proposals = proposals
        """The proposals each batch row verifies (its logits have a row per proposal, then its own)."""

    def apply_mask(
        self,
        grammar: GrammarOutput,
        token_bitmask: TokenBitmask,
        bitmask_argmax: OpImplementation | None,
        mask_graphs: MaskGraphs | None,
    ) -> SampledBatch | None:
        """Mask the logits of ``grammar``'s rows with its bitmask; returns the step's rows already sampled where
        every row is greedy and there is a fused ``bitmask_argmax`` op (None: the sampler samples them; pass None
        for the op under pipeline stages, whose last stage shares what it sampled)."""
        sampled = None
        if grammar.request_ids and self.logits is not None:
            rows_of, first = {}, 0
            for row in self.sampling:  # each sampling row's logits rows: one per proposal it verifies, then its own
                width = len(self.proposals.get(row, ())) + 1
                rows_of[self.states[row].request_id] = range(first, first + width)
                first += width
            rows = [index for request_id in grammar.request_ids for index in rows_of[request_id]]
            if (
                not self.proposals
                and bitmask_argmax is not None
                and all(plain_greedy(self.states[row]) for row in self.sampling)
            ):
                # Every row greedy: the mask and the argmax in one op (one kernel where the platform has it),
                # replayed with the status in one graph after a decode graph (every row of it samples).
                size = self.graph_size
                if (
                    mask_graphs is not None
                    and size is not None
                    and len(self.sampling) == len(self.states)
                    and mask_graphs.fits(rows, grammar.bitmask)
                ):
                    sampled = mask_graphs.sample(size, len(self.states), rows, grammar.bitmask)
                else:
                    tokens, healthy = token_bitmask.argmax(self.logits, rows, grammar.bitmask, bitmask_argmax)
                    sampled = greedy_batch(tokens, healthy)
            else:
                token_bitmask.apply(self.logits, rows, grammar.bitmask)
        return sampled
