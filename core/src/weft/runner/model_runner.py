"""Runs one step's :class:`~weft.contracts.executor.SchedulerOutput`: batch, forward, sample.

The runner keeps its own state of every request it was handed
(:class:`RequestState`: token ids, block ids per KV-cache group, sampling
parameters), created from the step's ``NewRequest`` and updated from its
``CachedRequest`` entries; it never reads the engine's scheduler or KV-cache
manager. It appends the tokens it samples to that state itself.

The batch lays the scheduled tokens of every request end to end. For each
KV-cache group it also builds the block table and each new token's cache slot
(as the group's spec lays them out), then asks the attention backend for its
metadata once for each group the backend owns; every layer reuses it. Groups a
model manages itself (compressed entries, recurrent state, rings) get no backend
metadata: the model reads their :class:`AttentionBatch` from the context.

Decode steps can replay captured graphs (:meth:`ModelRunner.capture_graphs`).
A graph is captured per batch size over static input buffers; a step of ``n``
decodes replays the smallest captured size ``>= n``, its extra rows padded as
one-token requests whose key and value go to a scratch block no request owns.
Steps with a prefill chunk, or more decodes than the largest size, run eagerly.

Asynchronous output: when every request of a step samples greedily with no
logprobs or penalties, the sampled ids stay on the device and are copied to the
host in the background; :meth:`ModelRunner.execute` returns before they arrive.
The next step reads a request's still-unknown last token from the device, so
scheduling and input preparation overlap the device's work.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.executor import (
    DoneStep,
    ModelRunnerOutput,
    NewRequest,
    SchedulerOutput,
    StepHandle,
    TokenLogprobs,
)
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.layers.attention import ForwardContext
from weft.runner.sampler import NON_FINITE_LOGITS, Sampler, greedy_maxima, plain_greedy

if TYPE_CHECKING:
    from weft.contracts.kv_connector import ConnectorOutput
    from weft.contracts.platform import Platform
    from weft.runner.kv_connector import WorkerConnector

logger = logging.getLogger("weft.runner")


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [size for size in (1, 2, 4) if size < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


class RequestState:
    """The runner's copy of one request."""

    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "params", "eos_token_ids", "generator",
                 "block_ids", "num_computed_tokens")

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        self.token_ids = list(new.token_ids)
        """Known token ids; with asynchronous output the last sampled one may still be on the device."""
        self.num_prompt_tokens = new.num_prompt_tokens
        self.params = new.params
        self.eos_token_ids = frozenset(new.eos_token_ids)
        self.generator = torch.Generator().manual_seed(new.params.seed) if new.params.seed is not None else None
        self.block_ids = [list(group) for group in new.block_ids]
        self.num_computed_tokens = new.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class StaticInputs:
    """Device buffers a captured graph reads; each step's decode inputs are copied into them."""

    def __init__(self, size: int, widths: Sequence[int], device: torch.device) -> None:
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(size, width, dtype=torch.int32, device=device) for width in widths]
        self.slot_mappings = [torch.zeros(size, dtype=torch.int32, device=device) for _ in widths]


class _PendingStep(StepHandle):
    """A step whose greedy tokens are being copied to the host."""

    def __init__(self, runner: ModelRunner, states: list[RequestState], sampling: list[int], logits: torch.Tensor,
                 connector_output: ConnectorOutput | None) -> None:
        self.runner = runner
        self.states = states
        self.request_ids = [state.request_id for state in states]
        self.sampling = sampling
        """Batch rows that sampled, in the order of ``device_tokens``."""
        self.device_tokens, healthy = greedy_maxima(logits)
        self.connector_output = connector_output
        # Tokens and health flags cross to the host in one copy.
        both = torch.stack([self.device_tokens, healthy.long()])
        self.host_tokens = torch.empty(both.shape, dtype=both.dtype, pin_memory=both.is_cuda)
        self.host_tokens.copy_(both, non_blocking=True)
        self.event = torch.cuda.Event() if both.is_cuda else None
        if self.event is not None:
            self.event.record()
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self.output is None:
            if self.event is not None:
                self.event.synchronize()
            tokens: list[int | None] = [None] * len(self.request_ids)
            failed: dict[str, str] = {}
            host_tokens, healthy = self.host_tokens.tolist()
            for row, token, ok in zip(self.sampling, host_tokens, healthy, strict=True):
                if ok:
                    tokens[row] = token
                else:
                    failed[self.request_ids[row]] = NON_FINITE_LOGITS
            self.output = self.runner.finish_step(self.states, tokens, {}, self.connector_output, failed)
        return self.output


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
        sampler: Sampler,
        connector: WorkerConnector | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.sampler = sampler
        self.connector = connector
        self.requests: dict[str, RequestState] = {}
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.static: StaticInputs | None = None
        self.scratch_blocks: list[int] = []
        self.max_model_len = 0
        self._pending: _PendingStep | None = None
        """The last step whose tokens may still be on their way to the host. Callers take a step's
        result before they launch the step after next."""

    # The step.

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepHandle:
        """Run one step; the handle's result has the sampled token of each scheduled request (None: mid-prefill)."""
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = RequestState(new)
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.new_block_ids is not None:
                for blocks, added in zip(state.block_ids, cached.new_block_ids):
                    blocks.extend(added)
        if step.is_empty:
            report = self.connector.poll(step.finished_request_ids) if self.connector is not None else None
            return DoneStep(ModelRunnerOutput([], [], connector_output=report))
        if self.connector is not None:
            self.connector.start_step(step.kv_connector_metadata)
        request_ids = list(step.num_scheduled_tokens)
        states = [self.requests[request_id] for request_id in request_ids]
        counts = list(step.num_scheduled_tokens.values())
        sampling = [row for row, (state, count) in enumerate(zip(states, counts))
                    if state.num_computed_tokens + count >= len(state.token_ids)]
        logits = self._forward(states, counts, sampling)
        report = self.connector.finish_step(step.finished_request_ids) if self.connector is not None else None
        # Each state's computed count moves past this step (the next step's CachedRequest confirms it).
        for state, count in zip(states, counts):
            state.num_computed_tokens += count
        if logits is None:
            return DoneStep(self.finish_step(states, [None] * len(request_ids), {}, report, {}))
        sampled_states = [states[row] for row in sampling]
        if all(plain_greedy(state) for state in sampled_states):
            self._pending = _PendingStep(self, states, sampling, logits, report)
            return self._pending
        self._resolve_pending()  # penalties and min_tokens read every earlier output token
        tokens: list[int | None] = [None] * len(request_ids)
        logprobs: dict[str, TokenLogprobs] = {}
        failed: dict[str, str] = {}
        for row, sampled in zip(sampling, self.sampler(logits, sampled_states)):
            if sampled.error is not None:
                failed[request_ids[row]] = sampled.error
                continue
            tokens[row] = sampled.token_id
            if sampled.logprob is not None:
                logprobs[request_ids[row]] = TokenLogprobs(sampled.logprob, sampled.rank, sampled.top_logprobs or [])
        return DoneStep(self.finish_step(states, tokens, logprobs, report, failed))

    def finish_step(self, states: list[RequestState], tokens: list[int | None], logprobs: dict[str, TokenLogprobs],
                    report: ConnectorOutput | None, failed: dict[str, str]) -> ModelRunnerOutput:
        """Append each sampled token to its request's state; returns the step's output (``failed``: requests
        that got no token, with the reason)."""
        failed_loads = report.failed_loads if report is not None else frozenset()
        for row, (state, token) in enumerate(zip(states, tokens)):
            if token is None:
                continue
            if state.request_id in failed_loads:  # computed over incomplete KV: the scheduler recomputes it
                tokens[row] = None
                continue
            if self.requests.get(state.request_id) is state:  # not dropped (finished, preempted) meanwhile
                state.token_ids.append(token)
        # A row computed over a failed load is recomputed, whatever its logits were (the load may have left garbage).
        failed = {request_id: reason for request_id, reason in failed.items() if request_id not in failed_loads}
        return ModelRunnerOutput([state.request_id for state in states], tokens, logprobs, report, failed)

    def _resolve_pending(self) -> None:
        # Taken first: a step whose result raises is reported once, not again by every later step.
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _forward(self, states: list[RequestState], counts: list[int], sampling: list[int]) -> torch.Tensor | None:
        """The logits of the rows in ``sampling`` (None when no row samples)."""
        count = len(states)
        if self.graphs and sum(counts) == count:
            size = self._graph_size(count)
            if size is not None:
                logits = self._replay(states, size)
                return logits if len(sampling) == count else logits[sampling]
        return self._execute_eager(states, counts, sampling)

    def _unknown_tokens(self, states: list[RequestState], counts: list[int]) -> tuple[list[int], list[int]] | None:
        """Batch positions whose token the previous step sampled but the host has not seen, and their rows there."""
        pending = self._pending
        if pending is None or pending.output is not None:
            return None
        previous = {pending.request_ids[row]: index for index, row in enumerate(pending.sampling)}
        positions, rows = [], []
        offset = 0
        for state, count in zip(states, counts):
            if state.num_computed_tokens + count > len(state.token_ids):
                positions.append(offset + count - 1)
                rows.append(previous[state.request_id])
            offset += count
        return (positions, rows) if positions else None

    def _gather_tokens(self, states: list[RequestState], counts: list[int]) -> list[int]:
        token_ids: list[int] = []
        for state, count in zip(states, counts):
            start = state.num_computed_tokens
            known = state.token_ids[start : start + count]
            token_ids.extend(known)
            token_ids.extend([0] * (count - len(known)))  # filled from the device (see _unknown_tokens)
        return token_ids

    def _fill_unknown(self, input_ids: torch.Tensor, states: list[RequestState], counts: list[int]) -> None:
        unknown = self._unknown_tokens(states, counts)
        if unknown is None:
            return
        positions, rows = unknown
        assert self._pending is not None
        source = self._pending.device_tokens[self._to_device(rows, torch.long)]
        input_ids.index_copy_(0, self._to_device(positions, torch.long), source)

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: a blocking host-to-device copy would wait for the step in flight.
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _execute_eager(self, states: list[RequestState], counts: list[int], sampling: list[int]) -> torch.Tensor | None:
        positions: list[int] = []
        query_start = [0]
        seq_lens = []
        for state, count in zip(states, counts):
            start = state.num_computed_tokens
            positions.extend(range(start, start + count))
            query_start.append(query_start[-1] + count)
            seq_lens.append(start + count)
        device = self.device
        input_ids = self._to_device(self._gather_tokens(states, counts), torch.long)
        self._fill_unknown(input_ids, states, counts)
        position_tensor = self._to_device(positions, torch.long)
        query_start_tensor = self._to_device(query_start, torch.int32)
        seq_lens_tensor = self._to_device(seq_lens, torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), query_start_tensor.diff().long())
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            tables = [state.block_ids[index] for state in states]
            width = max(len(table) for table in tables)
            block_table = torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32)
            block_table = block_table.to(device, non_blocking=True)
            slot_mapping = group.spec.slot_mapping(block_table, rows, position_tensor)
            batch = AttentionBatch(
                query_start=query_start_tensor,
                seq_lens=seq_lens_tensor,
                block_table=block_table,
                slot_mapping=slot_mapping.to(torch.int32),
                max_query_len=max(counts),
                max_seq_len=max(seq_lens),
                block_size=group.spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch) if group.spec.paged_attention else None)
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
        hidden = self.model(input_ids, position_tensor, context)
        if not sampling:
            return None
        last_rows = self._to_device([query_start[row + 1] - 1 for row in sampling], torch.long)
        return self.model.compute_logits(hidden[last_rows])

    # Graphs.

    @torch.inference_mode()
    def capture_graphs(self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int) -> float:
        """Capture the decode forward for each batch size (largest first); returns the seconds it took.

        ``scratch_blocks`` holds, per KV-cache group, a block id no request is
        ever given: padded rows write their keys and values there.
        """
        started = time.monotonic()
        self.scratch_blocks = list(scratch_blocks)
        self.max_model_len = max_model_len
        widths = [-(-max_model_len // group.spec.block_size) for group in self.groups]
        self.static = StaticInputs(max(sizes), widths, self.device)
        self._zeros = array("i", [0]) * max(widths)
        self._rows = torch.arange(max(sizes))
        self._fill_padding(0, max(sizes))
        for size in sorted(set(sizes), reverse=True):
            self.graphs[size] = platform.capture_graph(lambda size=size: self._static_forward(size))
        return time.monotonic() - started

    def _graph_size(self, count: int) -> int | None:
        fitting = [size for size in self.graphs if size >= count]
        return min(fitting) if fitting else None

    def _static_forward(self, size: int) -> torch.Tensor:
        """The decode forward over the first ``size`` rows of the static buffers; what a graph captures."""
        static = self.static
        assert static is not None
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            batch = AttentionBatch(
                query_start=static.query_start[: size + 1],
                seq_lens=static.seq_lens[:size],
                block_table=static.block_tables[index][:size],
                slot_mapping=static.slot_mappings[index][:size],
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_size=group.spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch))
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
        hidden = self.model(static.input_ids[:size], static.positions[:size], context)
        return self.model.compute_logits(hidden)

    def _fill_padding(self, start: int, stop: int) -> None:
        """Make rows ``start:stop`` one-token requests at position 0 that live in the scratch blocks."""
        static = self.static
        assert static is not None
        static.input_ids[start:stop] = 0
        static.positions[start:stop] = 0
        static.seq_lens[start:stop] = 1
        for index, group in enumerate(self.groups):
            static.block_tables[index][start:stop] = self.scratch_blocks[index]
            static.slot_mappings[index][start:stop] = self.scratch_blocks[index] * group.spec.block_size

    def _replay(self, states: list[RequestState], size: int) -> torch.Tensor:
        static = self.static
        assert static is not None
        count = len(states)
        counts = [1] * count
        positions = [state.num_computed_tokens for state in states]
        # Staged on the host (a few microseconds of CPU ops), then one copy each: device-side
        # derivations would add kernel launches to every decode step.
        host_positions = torch.tensor(positions)
        static.input_ids[:count].copy_(torch.tensor(self._gather_tokens(states, counts)), non_blocking=True)
        self._fill_unknown(static.input_ids, states, counts)
        static.positions[:count].copy_(host_positions, non_blocking=True)
        static.seq_lens[:count].copy_(host_positions + 1, non_blocking=True)
        for index, group in enumerate(self.groups):
            tables = [state.block_ids[index] for state in states]
            width = max(len(table) for table in tables)
            rows = array("i")  # the padded tables, flat: filled at C speed, then one copy to the device
            for table in tables:
                rows.extend(table)
                rows.extend(self._zeros[: width - len(table)])
            host_table = torch.frombuffer(rows, dtype=torch.int32).view(count, width)
            static.block_tables[index][:count, :width].copy_(host_table, non_blocking=True)
            static.slot_mappings[index][:count].copy_(
                group.spec.slot_mapping(host_table, self._rows[:count], host_positions), non_blocking=True
            )
        if count < size:
            self._fill_padding(count, size)
        logits = self.graphs[size]()
        return logits[:count]


def describe_sizes(sizes: Sequence[int]) -> str:
    """``1, 2, 4, 8..256 (35 sizes)`` for logs."""
    ordered = sorted(sizes)
    if len(ordered) <= 6:
        return ", ".join(map(str, ordered))
    return f"{', '.join(map(str, ordered[:4]))}..{ordered[-1]} ({len(ordered)} sizes)"
