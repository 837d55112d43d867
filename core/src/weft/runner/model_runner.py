"""Runs one step's :class:`~weft.contracts.executor.SchedulerOutput`: batch, forward, sample.

The runner keeps its own state of every request it was handed
(:class:`~weft.runner.request_state.RequestState`: token ids, block ids per KV-cache group, sampling
parameters), created from the step's ``NewRequest`` and updated from its
``CachedRequest`` entries; it never reads the engine's scheduler or KV-cache
manager. It appends the tokens it samples to that state itself.

The batch lays the scheduled tokens of every request end to end, with each KV-cache group's block table, cache
slots and attention metadata (:class:`~weft.runner.batch_inputs.InputBuilder`).

Decode steps can replay captured graphs (:meth:`DecodeGraphs.capture <weft.runner.graphs.DecodeGraphs.capture>`):
a step of decodes only that fits a captured batch size replays the graph over the static inputs, and a
speculating step (rows of a last token and up to ``k`` proposals) a verify graph
(:meth:`VerifyGraphs.capture <weft.runner.graphs.VerifyGraphs.capture>`); steps with a prefill chunk, a resumed
prefix hit or prompt logprobs, or more decodes than the largest size, run eagerly
(:class:`~weft.runner.forward.BatchForward` decides).

Asynchronous output: the sampler runs on the device without waiting for it
(:mod:`weft.runner.sampler`), so a step's sampled ids, their health and any
logprobs stay on the device and are copied to pinned host memory in the
background, one event marking the end; :meth:`ModelRunner.execute` returns before
they arrive (:class:`~weft.runner.step_handles.PendingStep`). The next step reads a request's still-unknown
last token from the device, so scheduling and input preparation overlap the device's work. Only a
step with a request whose sampling reads its output so far on the host
(``min_tokens``, bad words) first waits for the step before it. Penalties read
token counts the runner keeps on the device (:class:`~weft.runner.penalties.TokenCounts`):
each step counts the tokens it sampled there, and a request's row is freed when it
finishes or is preempted.

Structured outputs: a step that lists ``structured_output_request_ids`` stops after
the forward (:meth:`ModelRunner.execute` returns None, keeping an :class:`~weft.runner.step_handles.AwaitingMask`)
and samples in :meth:`ModelRunner.sample_tokens`, once the engine core sent the bitmask; the mask
is applied to the logits on the device. A constrained decode step whose rows are all plain greedy
replays the decode graph's mask graph instead (:class:`~weft.runner.graphs.MaskGraphs`).

Prompt logprobs: a request that asks for them runs its prefill eagerly, and the
step scores each prompt token it computed from the logits of the position before (:mod:`weft.runner.forward`).

Speculative decoding (:mod:`weft.runner.speculation`): a step's proposals stand in its requests' token ids for
the forward, which returns the logits of every proposed position and the last; the step verifies them instead
of sampling, and the rejected proposals' KV is left for the next step to overwrite.

Several ranks (:mod:`weft.distributed`): every rank runs the same steps and keeps
the same request state. Tensor ranks compute the whole vocabulary's logits and
sample alike; with pipeline stages the forward runs in micro-batches
(:mod:`weft.runner.pipeline`), the last stage samples and broadcasts the tokens to
every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from weft.contracts.attention import AttentionBackend
from weft.contracts.executor import (
    DoneStep,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    StepHandle,
    TokenLogprobs,
)
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.kv_connector import CapturedSparseEntryReader
from weft.contracts.ops import OpImplementation
from weft.contracts.speculator import Speculator, Verified
from weft.distributed.state import SINGLE, ParallelGroups
from weft.runner.batch_inputs import InputBuilder
from weft.runner.encoder import EncoderRunner
from weft.runner.forward import BatchForward
from weft.runner.graphs import DecodeGraphs, MaskGraphs, VerifyGraphs
from weft.runner.logits_processors import TokenBitmask
from weft.runner.penalties import TokenCounts
from weft.runner.pipeline import share_sampled
from weft.runner.request_state import RequestState
from weft.runner.sampler import SampledBatch, Sampler, draw_seed, needs_output_tokens
from weft.runner.speculation import Speculation, feeding_proposals
from weft.runner.step_handles import AwaitingMask, PendingStep, PromptLogprobs, StepTokens

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.runner.kv_connector import WorkerConnector

logger = logging.getLogger("weft.runner")


class ModelRunner:
    """Steps a worker's model: takes in each step's requests, batches, runs the forward (eagerly, through
    :class:`~weft.runner.graphs.DecodeGraphs` or in pipeline micro-batches) and samples."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
        sampler: Sampler,
        connector: WorkerConnector | None = None,
        parallel: ParallelGroups = SINGLE,
        bitmask_argmax: OpImplementation | None = None,
        speculator: Speculator | None = None,
        num_target_groups: int | None = None,
    ) -> None:
        """``groups``: every KV-cache group, the target's first ``num_target_groups`` (default: all), then the
        speculator's own."""
        self.model = model
        self.parallel = parallel
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.sampler = sampler
        self.connector = connector
        self.sparse_entries = connector.worker_side.sparse_entry_reader() if connector is not None else None
        self.inputs = InputBuilder(backend, groups, kv_caches, device, self.sparse_entries, connector)
        """Builds each eager forward's flat batch and context (:meth:`prepare_inputs`)."""
        captured_reader = self.sparse_entries if isinstance(self.sparse_entries, CapturedSparseEntryReader) else None
        self.decode_graphs = DecodeGraphs(
            model, backend, groups, kv_caches, device, parallel, captured_reader, bitmask_argmax
        )
        """Empty until the worker captures them (:meth:`DecodeGraphs.capture`): decode steps then run eagerly."""
        self.verify_graphs = VerifyGraphs(model, backend, groups, kv_caches, device)
        """Empty until the worker captures them (:meth:`VerifyGraphs.capture`, speculative decoding on): speculating
        steps then run eagerly."""
        self.forward = BatchForward(
            model,
            parallel,
            self.inputs,
            self.decode_graphs,
            connector,
            device,
            self._fill_unknown,
            speculator,
            self.verify_graphs,
        )
        """Runs each step's forward (eagerly, replaying a decode graph or in pipeline micro-batches)."""
        self.requests: dict[str, RequestState] = {}
        self._pending: PendingStep | None = None
        """The last step whose tokens may still be on their way to the host. Callers take a step's
        result before they launch the step after next."""
        self._awaiting: AwaitingMask | None = None
        self._deferred: SchedulerOutput | None = None
        """A step that came with ``launch_after_sampling``: launched by the next :meth:`sample_tokens`; its
        decode-graph inputs are staged when it comes (:meth:`DecodeGraphs.stage_ahead`)."""
        self.token_bitmask = TokenBitmask(device)
        self.bitmask_argmax = bitmask_argmax
        """The ``bitmask_argmax`` op the worker chose: a structured-output step of greedy rows masks and samples
        in one call (None: the bitmask is applied to the logits, then the sampler samples)."""
        self.token_counts = TokenCounts(device)
        """Penalized requests' token counts, on the device (filled where the sampler runs)."""
        draft_groups = range(num_target_groups if num_target_groups is not None else len(groups), len(groups))
        self.speculation = Speculation(speculator, sampler, draft_groups)
        """Proposes each request's next tokens after its step, and verifies the steps that carry proposals."""
        self.encoder: EncoderRunner | None = None
        """Encodes the steps' images (:meth:`use_encoder`); None: the model reads text only."""

    def use_encoder(self, encoder: EncoderRunner) -> None:
        """Encode the images steps ask for with ``encoder`` and merge them into the steps' batches."""
        self.encoder = self.inputs.encoder = encoder

    @property
    def graphs(self) -> dict[int, Callable[[], torch.Tensor]]:
        """The captured decode graphs by batch size (empty: decode steps run eagerly)."""
        return self.decode_graphs.graphs

    @property
    def last_graph_size(self) -> int | None:
        """The captured batch size the last forward replayed; None when it ran eagerly (read by
        :class:`weft.engine.core.step_profile.StepProfile`)."""
        return self.forward.last_graph_size

    @property
    def mask_graphs(self) -> MaskGraphs | None:
        """The decode graphs' mask graphs (None: not captured, or no fused ``bitmask_argmax`` op)."""
        return self.decode_graphs.mask_graphs

    # The step.

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepHandle | None:
        """Run one step; the handle's result has the sampled token of each scheduled request (None: mid-prefill).
        None: the step has structured outputs, sampled by :meth:`sample_tokens`; with ``launch_after_sampling``, its
        inputs are staged now and its forward runs once :meth:`sample_tokens` sampled the step before."""
        stale, self._deferred, self.decode_graphs.staged = self._deferred, None, None
        if stale is not None:  # never launched (the step before failed to sample): its requests' changes still hold
            self._update_requests(stale)
        if step.launch_after_sampling:
            if self._awaiting is None:
                raise RuntimeError("a step came with launch_after_sampling, but no step waits for its bitmask")
            self._deferred = step
            if self.connector is None:  # a connector's per-step work comes first: that step runs as it comes
                self.decode_graphs.stage_ahead(step, self.requests)
            return None
        return self._execute(step)

    def _update_requests(self, step: SchedulerOutput) -> None:
        """Take in the step's new requests, drop its finished ones and move the cached ones along."""
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
            self.token_counts.free(request_id)
            self.speculation.remove_request(request_id)
        for new in step.new_requests:
            self.token_counts.free(new.request_id)  # a new state's counts are built again from its token ids
            self.requests[new.request_id] = RequestState(new, self.device)
            self.speculation.add_request(new)
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_block_ids is not None:
                for blocks, added in zip(state.block_ids, cached.new_block_ids, strict=False):
                    blocks.extend(added)
        if self.encoder is not None:
            self.encoder.update(step, self.requests)

    def _execute(self, step: SchedulerOutput) -> StepHandle | None:
        self._update_requests(step)
        if step.is_empty:
            report = (
                self.connector.poll(step.kv_connector_metadata, step.finished_request_ids)
                if self.connector is not None
                else None
            )
            return DoneStep(ModelRunnerOutput([], [], connector_output=report))
        if self.connector is not None:
            self.connector.start_step(step.kv_connector_metadata, step.has_sync_kv_loads)
        request_ids = list(step.num_scheduled_tokens)
        states = [self.requests[request_id] for request_id in request_ids]
        counts = list(step.num_scheduled_tokens.values())
        proposals = {  # by batch row
            row: step.spec_token_ids[request_id]
            for row, request_id in enumerate(request_ids)
            if request_id in step.spec_token_ids
        }
        prompt_logprobs: PromptLogprobs = {}
        with feeding_proposals(states, proposals):
            sampling = [
                row
                for row, (state, count) in enumerate(zip(states, counts, strict=False))
                if state.num_computed_tokens + count >= len(state.token_ids)
            ]
            logits = self.forward.run(states, counts, sampling, prompt_logprobs, proposals)
        report = self.connector.finish_step(step.finished_request_ids) if self.connector is not None else None
        # Each state's computed count moves past this step (the next step's CachedRequest confirms it; a verified
        # row's moves back to its last accepted token when its tokens are known: finish_step).
        for state, count in zip(states, counts, strict=False):
            state.num_computed_tokens += count
        if step.structured_output_request_ids:
            self._awaiting = AwaitingMask(
                states, sampling, logits, report, prompt_logprobs, self.last_graph_size, proposals
            )
            return None
        return self._sample_step(states, sampling, logits, report, prompt_logprobs, proposals=proposals)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        """Sample the step :meth:`execute` left waiting, its constrained rows masked by ``grammar``; then launch the
        step deferred behind it (``launch_after_sampling``), whose forward reads the tokens just sampled."""
        deferred, self._deferred = self._deferred, None
        try:
            handle = self._sample_awaiting(grammar)
        except BaseException:
            self._deferred = deferred  # never launched: the next execute takes in its requests' changes
            raise
        if deferred is not None:
            self._execute(deferred)  # a structured-output step: it waits for its own bitmask
        return handle

    def _sample_awaiting(self, grammar: GrammarOutput) -> StepHandle:
        awaiting, self._awaiting = self._awaiting, None
        assert awaiting is not None, "sample_tokens without a step waiting for its bitmask"
        pipelined = self.parallel.layout.pipeline_parallel_size > 1  # the last stage shares what it sampled
        fused = None if pipelined else self.bitmask_argmax
        sampled = awaiting.apply_mask(grammar, self.token_bitmask, fused, self.mask_graphs)
        return self._sample_step(
            awaiting.states,
            awaiting.sampling,
            awaiting.logits,
            awaiting.report,
            awaiting.prompt_logprobs,
            sampled,
            awaiting.proposals,
        )

    def _sample_step(
        self,
        states: list[RequestState],
        sampling: list[int],
        logits: torch.Tensor | None,
        report: ConnectorOutput | None,
        prompt_logprobs: PromptLogprobs,
        sampled: SampledBatch | None = None,
        proposals: dict[int, list[int]] | None = None,
    ) -> StepHandle:
        """Sample the step's rows (``sampled``: already sampled, by :meth:`sample_tokens`), or verify the
        ``proposals`` of its speculating rows (by batch row), and start their way to the host."""
        if not sampling:
            return DoneStep(self.finish_step(states, [None] * len(states), {}, report, {}, prompt_logprobs))
        sampled_states = [states[row] for row in sampling]
        if any(needs_output_tokens(state) for state in sampled_states):
            self._resolve_pending()  # min_tokens and bad words read every earlier output token
        if proposals:
            assert logits is not None, "speculative decoding runs without pipeline stages"
            proposed = [proposals.get(row, []) for row in sampling]
            verified = self.speculation.verify(logits, sampled_states, proposed, self.token_counts)
            self.token_counts.record_kept(
                sampled_states, verified.tokens, verified.num_tokens, verified.starts, _failed_loads(report)
            )
            self._pending = PendingStep(
                self.finish_step, states, sampling, verified, report, prompt_logprobs, proposals
            )
            return self._pending
        for state in sampled_states:
            if state.generator is not None:  # the draw of the token at this position, however the request got here
                state.generator.manual_seed(draw_seed(state.params.seed, state.num_computed_tokens))
        if sampled is None:
            sampled = self._sample(logits, sampled_states)
        self.token_counts.record(sampled_states, sampled.tokens, _failed_loads(report))
        self._pending = PendingStep(self.finish_step, states, sampling, sampled, report, prompt_logprobs)
        return self._pending

    def _sample(self, logits: torch.Tensor | None, states: list[RequestState]) -> SampledBatch:
        """The sampler's rows, on the device (under pipeline parallelism, the last stage's: :func:`share_sampled`)."""
        sampled = self.sampler.sample(logits, states, self.token_counts) if logits is not None else None
        if self.parallel.layout.pipeline_parallel_size == 1:
            assert sampled is not None
            return sampled
        return share_sampled(self.parallel, sampled, len(states), self.device)

    def finish_step(
        self,
        states: list[RequestState],
        tokens: list[int | None],
        logprobs: dict[str, TokenLogprobs],
        report: ConnectorOutput | None,
        failed: dict[str, str],
        prompt_logprobs: PromptLogprobs | None = None,
        gained: StepTokens | None = None,
        proposals: dict[int, list[int]] | None = None,
    ) -> ModelRunnerOutput:
        """Append each sampled token (and the accepted proposals of ``gained``) to its request's state; returns the
        step's output (``failed``: requests that got no token, with the reason), with the speculator's proposals
        for the next step."""
        failed_loads = _failed_loads(report)
        more = gained.more_token_ids if gained is not None else {}
        proposals = proposals or {}
        verified: list[Verified] = []
        for row, (state, token) in enumerate(zip(states, tokens, strict=False)):
            if token is None:
                continue
            if state.request_id in failed_loads:  # computed over incomplete KV: the scheduler recomputes it
                tokens[row] = None
                more.pop(state.request_id, None)
                continue
            if self.requests.get(state.request_id) is not state:  # dropped (finished, preempted) meanwhile
                continue
            accepted = more.get(state.request_id, [])
            state.token_ids.append(token)
            state.token_ids.extend(accepted)
            proposed = len(proposals.get(row, ()))
            # The KV of the rejected proposals is discarded: the next step overwrites it.
            state.num_computed_tokens -= proposed - len(accepted)
            verified.append(Verified(state.request_id, proposed, len(accepted), [token, *accepted]))
        # A row computed over a failed load is recomputed, whatever its logits were (the load may have left garbage).
        failed = {request_id: reason for request_id, reason in failed.items() if request_id not in failed_loads}
        return ModelRunnerOutput(
            [state.request_id for state in states],
            tokens,
            logprobs,
            report,
            failed,
            prompt_logprobs or {},
            more_token_ids=more,
            more_logprobs=gained.more_logprobs if gained is not None else {},
            spec_token_ids=self.speculation.propose(verified, self.requests),
        )

    def _resolve_pending(self) -> None:
        # Taken first: a step whose result raises is reported once, not again by every later step.
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _fill_unknown(self, input_ids: torch.Tensor, states: list[RequestState], counts: list[int]) -> None:
        if self._pending is not None:
            self._pending.fill_unknown(input_ids, states, counts)


def _failed_loads(report: ConnectorOutput | None) -> frozenset[str]:
    """Requests whose step computed over a failed KV load: the runner discards what it sampled for them."""
    return report.failed_loads if report is not None else frozenset()


def describe_sizes(sizes: Sequence[int]) -> str:
    """``1, 2, 4, 8..256 (35 sizes)`` for logs."""
    ordered = sorted(sizes)
    if len(ordered) <= 6:
        return ", ".join(map(str, ordered))
    return f"{', '.join(map(str, ordered[:4]))}..{ordered[-1]} ({len(ordered)} sizes)"
