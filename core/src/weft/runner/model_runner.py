"""Runs one step's :class:`~weft.contracts.executor.SchedulerOutput`: batch, forward, sample.

The runner keeps its own state of every request it was handed
(:class:`~weft.runner.request_state.RequestState`: token ids, block ids per KV-cache group, sampling
parameters), created from the step's ``NewRequest`` and updated from its
``CachedRequest`` entries; it never reads the engine's scheduler or KV-cache
manager. It appends the tokens it samples to that state itself.

The batch lays the scheduled tokens of every request end to end, with each KV-cache group's block table, cache
slots and attention metadata (:class:`~weft.runner.batch_inputs.InputBuilder`).

Decode steps can replay captured graphs (:meth:`ModelRunner.capture_graphs`, :mod:`weft.runner.graphs`):
a step of decodes only that fits a captured batch size replays the graph over the static inputs;
steps with a prefill chunk, a resumed prefix hit or prompt logprobs, or more decodes than the
largest size, run eagerly.

Asynchronous output: the sampler runs on the device without waiting for it
(:mod:`weft.runner.sampler`), so a step's sampled ids, their health and any
logprobs stay on the device and are copied to pinned host memory in the
background, one event marking the end; :meth:`ModelRunner.execute` returns before
they arrive. The next step reads a request's still-unknown last token from the
device, so scheduling and input preparation overlap the device's work. Only a
step with a request whose sampling reads its output so far on the host
(``min_tokens``, bad words) first waits for the step before it. Penalties read
token counts the runner keeps on the device (:class:`~weft.runner.penalties.TokenCounts`):
each step counts the tokens it sampled there, and a request's row is freed when it
finishes or is preempted.

Structured outputs: a step that lists ``structured_output_request_ids`` stops after
the forward (:meth:`ModelRunner.execute` returns None) and samples in
:meth:`ModelRunner.sample_tokens`, once the engine core sent the bitmask; the mask
is applied to the logits on the device. A constrained decode step whose rows are all plain greedy
replays the decode graph's mask graph instead (:class:`~weft.runner.graphs.MaskGraphs`).

Prompt logprobs: a request that asks for them runs its prefill eagerly, and the
step scores each prompt token it computed from the logits of the position before.

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
from weft.contracts.speculator import (
    DraftInputs,
    ProposalStep,
    SpeculationRequest,
    Speculator,
    TargetHiddenStates,
    Verified,
)
from weft.distributed.state import SINGLE, ParallelGroups
from weft.layers.attention import ForwardContext
from weft.runner.batch_inputs import InputBuilder, known_tokens
from weft.runner.encoder import EncoderRunner
from weft.runner.graphs import DecodeGraphs, MaskGraphs
from weft.runner.logits_processors import TokenBitmask, to_device
from weft.runner.penalties import TokenCounts
from weft.runner.pipeline import forward_in_micro_batches, share_sampled
from weft.runner.rejection_sampler import RejectionSampler, VerifiedBatch
from weft.runner.request_state import RequestState
from weft.runner.sampler import (
    SampledBatch,
    SampledToken,
    Sampler,
    draw_seed,
    greedy_batch,
    needs_output_tokens,
    plain_greedy,
)

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.contracts.platform import Platform
    from weft.runner.kv_connector import WorkerConnector

logger = logging.getLogger("weft.runner")


PromptLogprobs = dict[str, tuple[int, list[TokenLogprobs]]]


class _PendingStep(StepHandle):
    """A step whose sampled tokens are being copied to the host."""

    def __init__(
        self,
        runner: ModelRunner,
        states: list[RequestState],
        sampling: list[int],
        sampled: SampledBatch | VerifiedBatch,
        connector_output: ConnectorOutput | None,
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]] | None = None,
    ) -> None:
        """``sampled``: one row per entry of ``sampling``, on the device (a :class:`VerifiedBatch` where the step
        verified ``proposals``, by batch row)."""
        self.runner = runner
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
            self.output = self.runner.finish_step(
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


class _AwaitingMask:
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
        self.proposals = proposals
        """The proposals each batch row verifies (its logits have a row per proposal, then its own)."""
        """The decode graph the forward replayed (its logits are that graph's output); None: it ran eagerly."""

    def apply_mask(self, grammar: GrammarOutput, runner: ModelRunner) -> SampledBatch | None:
        """Mask the logits of ``grammar``'s rows with its bitmask; returns the step's rows already sampled where
        every row is greedy and ``runner`` has the fused ``bitmask_argmax`` op (None: the sampler samples them)."""
        sampled = None
        if grammar.request_ids and self.logits is not None:
            row_of, first = {}, 0
            for row in self.sampling:  # each sampling row's first logits row (constrained rows propose nothing)
                row_of[self.states[row].request_id] = first
                first += len(self.proposals.get(row, ())) + 1
            rows = [row_of[request_id] for request_id in grammar.request_ids]
            if (
                not self.proposals
                and runner.bitmask_argmax is not None
                and runner.parallel.layout.pipeline_parallel_size == 1
                and all(plain_greedy(self.states[row]) for row in self.sampling)
            ):
                # Every row greedy: the mask and the argmax in one op (one kernel where the platform has it),
                # replayed with the status in one graph after a decode graph (every row of it samples).
                size = self.graph_size
                if (
                    runner.mask_graphs is not None
                    and size is not None
                    and len(self.sampling) == len(self.states)
                    and runner.mask_graphs.fits(rows, grammar.bitmask)
                ):
                    sampled = runner.mask_graphs.sample(size, len(self.states), rows, grammar.bitmask)
                else:
                    tokens, healthy = runner.token_bitmask.argmax(
                        self.logits, rows, grammar.bitmask, runner.bitmask_argmax
                    )
                    sampled = greedy_batch(tokens, healthy)
            else:
                runner.token_bitmask.apply(self.logits, rows, grammar.bitmask)
        return sampled


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
        """Empty until :meth:`capture_graphs`: decode steps then run eagerly."""
        self.requests: dict[str, RequestState] = {}
        self.last_graph_size: int | None = None
        """The captured batch size the last forward replayed; None when it ran eagerly (read by
        :class:`weft.engine.core.step_profile.StepProfile`)."""
        self._pending: _PendingStep | None = None
        """The last step whose tokens may still be on their way to the host. Callers take a step's
        result before they launch the step after next."""
        self._awaiting: _AwaitingMask | None = None
        self._deferred: SchedulerOutput | None = None
        """A step that came with ``launch_after_sampling``: launched by the next :meth:`sample_tokens`; its
        decode-graph inputs are staged when it comes (:meth:`DecodeGraphs.stage_ahead`)."""
        self.token_bitmask = TokenBitmask(device)
        self.bitmask_argmax = bitmask_argmax
        """The ``bitmask_argmax`` op the worker chose: a structured-output step of greedy rows masks and samples
        in one call (None: the bitmask is applied to the logits, then the sampler samples)."""
        self.token_counts = TokenCounts(device)
        """Penalized requests' token counts, on the device (filled where the sampler runs)."""
        self.speculator = speculator
        """Proposes each request's next tokens after its step (None: speculative decoding is off)."""
        self.rejection_sampler = RejectionSampler(sampler)
        self._draft_probs: dict[str, torch.Tensor] = {}
        """The distributions of a sampling speculator's proposals, by request, until its step verifies them."""
        self.draft_groups = range(num_target_groups if num_target_groups is not None else len(groups), len(groups))
        """The indices of the speculator's own KV-cache groups (empty: it owns no model)."""
        """Verifies the steps that carry proposals (``SchedulerOutput.spec_token_ids``)."""
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
    def mask_graphs(self) -> MaskGraphs | None:
        """The decode graphs' mask graphs (None: not captured, or no fused ``bitmask_argmax`` op)."""
        return self.decode_graphs.mask_graphs

    @torch.inference_mode()
    def capture_graphs(
        self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int
    ) -> float:
        """Capture the decode forward for each batch size (:meth:`DecodeGraphs.capture`); returns the seconds."""
        return self.decode_graphs.capture(platform, sizes, scratch_blocks, max_model_len)

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
        speculator = self.speculator
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
            self._draft_probs.pop(request_id, None)
            self.token_counts.free(request_id)
            if speculator is not None:
                speculator.remove_request(request_id)
        for new in step.new_requests:
            self.token_counts.free(new.request_id)  # a new state's counts are built again from its token ids
            self.requests[new.request_id] = RequestState(new, self.device)
            if speculator is not None:
                speculator.remove_request(new.request_id)  # resumed after a preemption: followed again from its tokens
                speculator.add_request(
                    SpeculationRequest(
                        new.request_id, new.token_ids[: new.num_prompt_tokens], new.token_ids[new.num_prompt_tokens :]
                    )
                )
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
        # A speculating row feeds its proposals after its last token: they stand in its token ids for the forward.
        proposals = {
            row: step.spec_token_ids[request_id]
            for row, request_id in enumerate(request_ids)
            if request_id in step.spec_token_ids
        }
        for row, proposed in proposals.items():
            states[row].token_ids.extend(proposed)
        sampling = [
            row
            for row, (state, count) in enumerate(zip(states, counts, strict=False))
            if state.num_computed_tokens + count >= len(state.token_ids)
        ]
        prompt_logprobs: PromptLogprobs = {}
        try:
            logits = self._forward(states, counts, sampling, prompt_logprobs, proposals)
        finally:
            for row, proposed in proposals.items():
                del states[row].token_ids[-len(proposed) :]
        report = self.connector.finish_step(step.finished_request_ids) if self.connector is not None else None
        # Each state's computed count moves past this step (the next step's CachedRequest confirms it; a verified
        # row's moves back to its last accepted token when its tokens are known: finish_step).
        for state, count in zip(states, counts, strict=False):
            state.num_computed_tokens += count
        if step.structured_output_request_ids:
            self._awaiting = _AwaitingMask(
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
        sampled = awaiting.apply_mask(grammar, self)
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
            # The position of the token each row's first logits draw (its seeded draws follow from it).
            first_positions = [
                state.num_computed_tokens - len(row_proposals)
                for state, row_proposals in zip(sampled_states, proposed, strict=True)
            ]
            verified = self.rejection_sampler.verify(
                logits,
                sampled_states,
                proposed,
                first_positions,
                self._take_draft_probs(sampled_states, proposed, logits),
                self.token_counts,
            )
            self.token_counts.record_kept(
                sampled_states, verified.tokens, verified.num_tokens, verified.starts, _failed_loads(report)
            )
            self._pending = _PendingStep(self, states, sampling, verified, report, prompt_logprobs, proposals)
            return self._pending
        for state in sampled_states:
            if state.generator is not None:  # the draw of the token at this position, however the request got here
                state.generator.manual_seed(draw_seed(state.params.seed, state.num_computed_tokens))
        if sampled is None:
            sampled = self._sample(logits, sampled_states)
        self.token_counts.record(sampled_states, sampled.tokens, _failed_loads(report))
        self._pending = _PendingStep(self, states, sampling, sampled, report, prompt_logprobs)
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
            spec_token_ids=self._propose(verified) if self.speculator is not None and verified else {},
        )

    def _propose(self, verified: list[Verified]) -> dict[str, list[int]]:
        """Tell the speculator what the step's requests gained, and take its proposals for their next step."""
        speculator = self.speculator
        assert speculator is not None
        speculator.on_verified(verified)
        k = speculator.config.num_speculative_tokens
        ids, limits = [], []
        for result in verified:
            state = self.requests[result.request_id]
            if state.params.structured_outputs is not None:
                continue  # a constrained request decodes one token per step
            left = k
            if state.params.max_tokens is not None:
                left = min(k, state.params.max_tokens - len(state.token_ids) + state.num_prompt_tokens - 1)
            ids.append(result.request_id)
            limits.append(max(left, 0))
        if not ids:
            return {}
        draft_inputs = None
        if self.draft_groups:
            draft_inputs = DraftInputs(
                [[self.requests[request_id].block_ids[group] for group in self.draft_groups] for request_id in ids]
            )
        made = speculator.propose(ProposalStep(ids, limits, draft_inputs))
        if made.probs is not None:  # drawn proposals: the verification needs each one's distribution
            start = 0
            for request_id, proposed, limit in zip(ids, made.token_ids, limits, strict=True):
                if proposed and limit:
                    self._draft_probs[request_id] = made.probs[start : start + min(len(proposed), limit)]
                start += len(proposed)
        return {
            request_id: proposed[:limit]
            for request_id, proposed, limit in zip(ids, made.token_ids, limits, strict=True)
            if proposed and limit
        }

    def _take_draft_probs(
        self, states: list[RequestState], proposed: list[list[int]], logits: torch.Tensor
    ) -> torch.Tensor | None:
        """The distributions the rows' proposals were drawn from, request-major (one-hot rows for deterministic
        proposals beside drawn ones); None when every row's proposals are deterministic."""
        stored = [self._draft_probs.pop(state.request_id, None) for state in states]
        if all(probs is None for probs in stored):
            return None
        parts = []
        for probs, tokens in zip(stored, proposed, strict=True):
            if not tokens:
                continue
            if probs is None:
                ids = torch.tensor(tokens, device=logits.device)
                probs = torch.nn.functional.one_hot(ids, logits.shape[-1]).float()
            parts.append(probs[: len(tokens)].to(logits.device, torch.float32))
        return torch.cat(parts)

    def _resolve_pending(self) -> None:
        # Taken first: a step whose result raises is reported once, not again by every later step.
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _forward(
        self,
        states: list[RequestState],
        counts: list[int],
        sampling: list[int],
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]] | None = None,
    ) -> torch.Tensor | None:
        """The logits of the rows in ``sampling`` (None when no row samples, or on a stage before the last), a
        speculating row's at each of its proposals then its last position (``proposals``, by batch row); fills
        ``prompt_logprobs`` (not under pipeline parallelism, which refuses prompt logprobs)."""
        if self.parallel.layout.pipeline_parallel_size > 1:
            return forward_in_micro_batches(self.model, self.parallel, self.prepare_inputs, states, counts, sampling)
        count = len(states)
        scores_prompt = any(
            _scored_prompt_positions(state, count) for state, count in zip(states, counts, strict=False)
        )
        resumes = any(state.prefix_hit is None and state.num_computed_tokens for state in states)
        images = self.encoder is not None and self.encoder.needed(states, counts)  # graphs are captured for text
        if self.graphs and sum(counts) == count and not scores_prompt and not resumes and not images:
            size = self.decode_graphs.size_for(count)
            if size is not None:
                for state in states:
                    state.take_prefix_hit()  # none resumes from a hit here: replays start from the ring as it is
                if self.connector is not None:
                    self.connector.wait_for_all_layers()  # a captured graph's layers wait for nothing
                self.last_graph_size = size
                logits = self._replay(states, size)
                return logits if len(sampling) == count else logits[sampling]
        self.last_graph_size = None
        return self._execute_eager(states, counts, sampling, prompt_logprobs, proposals or {})

    def _replay(self, states: list[RequestState], size: int) -> torch.Tensor:
        self.decode_graphs.stage(states, size)
        static = self.decode_graphs.static
        assert static is not None
        counts = [1] * len(states)
        static.input_ids[: len(states)].copy_(torch.tensor(known_tokens(states, counts)), non_blocking=True)
        self._fill_unknown(static.input_ids, states, counts)
        return self.decode_graphs.replay(states, size)

    def _fill_unknown(self, input_ids: torch.Tensor, states: list[RequestState], counts: list[int]) -> None:
        if self._pending is not None:
            self._pending.fill_unknown(input_ids, states, counts)

    def _execute_eager(
        self,
        states: list[RequestState],
        counts: list[int],
        sampling: list[int],
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]],
    ) -> torch.Tensor | None:
        input_ids, positions, context, query_start = self.prepare_inputs(states, counts)
        hidden = self.model(input_ids, positions, context)
        if self.speculator is not None and self.speculator.needs_hidden_states:
            self.speculator.take_hidden_states(target_hidden_states(self.model, states, counts, hidden))
        _score_prompts(self.model, states, counts, hidden, query_start, prompt_logprobs)
        if not sampling:
            return None
        rows = []
        for row in sampling:
            end = query_start[row + 1]
            rows.extend(range(end - len(proposals.get(row, ())) - 1, end))
        last_rows = to_device(rows, torch.long, self.device)
        return self.model.compute_logits(hidden[last_rows])

    def prepare_inputs(
        self, states: list[RequestState], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Token ids, positions and the forward context of ``states`` (``counts`` tokens each); and where
        each request's tokens start in the flat batch (:meth:`InputBuilder.build`)."""
        return self.inputs.build(states, counts, self._fill_unknown)


def target_hidden_states(
    model: torch.nn.Module, states: list[RequestState], counts: list[int], hidden: torch.Tensor
) -> TargetHiddenStates:
    """The forward's hidden states as a speculator reads them (``hidden``, or what the model's
    ``hidden_states_for_speculation`` makes of it), with each request's first position and row count."""
    select = getattr(model, "hidden_states_for_speculation", None)
    return TargetHiddenStates(
        [state.request_id for state in states],
        [state.num_computed_tokens for state in states],
        list(counts),
        select(hidden) if select is not None else hidden,
    )


def _failed_loads(report: ConnectorOutput | None) -> frozenset[str]:
    """Requests whose step computed over a failed KV load: the runner discards what it sampled for them."""
    return report.failed_loads if report is not None else frozenset()


_PROMPT_LOGPROB_CHUNK = 256
"""Prompt positions scored at once (their logits are ``chunk x vocab`` floats)."""


def _scored_prompt_positions(state: RequestState, count: int) -> range:
    """Positions of this step whose logits score a prompt token (the next one), for a request that asked."""
    if state.params.prompt_logprobs is None:
        return range(0)
    start = state.num_computed_tokens
    return range(start, min(start + count, state.num_prompt_tokens - 1))


def _score_prompts(
    model: torch.nn.Module,
    states: list[RequestState],
    counts: list[int],
    hidden: torch.Tensor,
    query_start: list[int],
    prompt_logprobs: PromptLogprobs,
) -> None:
    """Score, into ``prompt_logprobs``, the prompt tokens each request that asks for them computed in this step."""
    for row, (state, count) in enumerate(zip(states, counts, strict=False)):
        positions_scored = _scored_prompt_positions(state, count)
        if positions_scored:
            prompt_logprobs[state.request_id] = _score_prompt(model, state, hidden, query_start[row], positions_scored)


def _score_prompt(
    model: torch.nn.Module, state: RequestState, hidden: torch.Tensor, batch_start: int, positions: range
) -> tuple[int, list[TokenLogprobs]]:
    """Logprobs of prompt tokens ``positions.start + 1 ..`` from the logits at ``positions``."""
    top = state.params.prompt_logprobs or 0
    entries: list[TokenLogprobs] = []
    first = batch_start + positions.start - state.num_computed_tokens  # this step's rows start at the computed count
    for chunk in range(0, len(positions), _PROMPT_LOGPROB_CHUNK):
        rows = range(first + chunk, first + min(chunk + _PROMPT_LOGPROB_CHUNK, len(positions)))
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows.start : rows.stop]).float(), dim=-1).cpu()
        targets = torch.tensor(state.token_ids[positions.start + chunk + 1 : positions.start + chunk + 1 + len(rows)])
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        best = logprobs.topk(top, dim=-1) if top else None
        for index in range(len(rows)):
            candidates = (
                list(zip(best.indices[index].tolist(), best.values[index].tolist(), strict=False))
                if best is not None
                else []
            )
            entries.append(TokenLogprobs(float(chosen[index]), int(ranks[index]), candidates))
    return positions.start + 1, entries


def describe_sizes(sizes: Sequence[int]) -> str:
    """``1, 2, 4, 8..256 (35 sizes)`` for logs."""
    ordered = sorted(sizes)
    if len(ordered) <= 6:
        return ", ".join(map(str, ordered))
    return f"{', '.join(map(str, ordered[:4]))}..{ordered[-1]} ({len(ordered)} sizes)"
