"""Decode graphs: the decode forward captured per batch size over static input buffers, and replayed.

A graph is captured per batch size over :class:`StaticInputs`; a step of ``n`` decodes replays the smallest
captured size ``>= n``, its extra rows padded as one-token requests whose key and value go to a scratch block no
request owns. Steps with a prefill chunk, or more decodes than the largest size, run eagerly (the
:class:`~weft.runner.model_runner.ModelRunner` decides). A KV connector's sparse entry reader takes part in a graph
only when it keeps its per-step state in static buffers
(:class:`~weft.contracts.kv_connector.CapturedSparseEntryReader`): they are refilled before every replay, for the
step's rows, and reset for the padding. Under tensor parallelism a captured graph ends at the hidden states: the LM
head's all-gather runs after the replay.

Where a ``bitmask_argmax`` op was chosen, :class:`MaskGraphs` holds a second graph per batch size that masks the
decode graph's logits and takes each row's greedy token (the op, the rows' status, one ``[2, size]`` tensor): a
constrained decode step whose rows are all plain greedy stages the bitmask, copies it to the device and replays that
graph, one host call for what was half a dozen launches (on an H200, 35 us of host time against 212 us for
SmolLM2's vocabulary at batch 32).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy
import torch

from weft.contracts.attention import AttentionBackend, AttentionBatch
from weft.contracts.executor import SchedulerOutput
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.kv_connector import CapturedSparseEntryReader
from weft.contracts.ops import OpImplementation
from weft.distributed.state import ParallelGroups
from weft.layers.attention import ForwardContext
from weft.layers.nano_batches import decode_nano_batches
from weft.runner.logits_processors import _words_at, mask_rows_of
from weft.runner.request_state import RequestState
from weft.runner.sampler import SampledBatch, greedy_status

if TYPE_CHECKING:
    from weft.contracts.platform import Platform


class StaticInputs:
    """Device buffers a captured graph reads; each step's inputs are copied into them: ``size`` request rows and
    ``tokens`` query tokens (default: one a row, a decode graph's)."""

    def __init__(self, size: int, widths: Sequence[int], device: torch.device, tokens: int | None = None) -> None:
        tokens = size if tokens is None else tokens
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(size, width, dtype=torch.int32, device=device) for width in widths]
        self.slot_mappings = [torch.zeros(tokens, dtype=torch.int32, device=device) for _ in widths]


class _Staged:
    """A deferred step's decode-graph inputs, staged in the static buffers (:meth:`DecodeGraphs.stage_ahead`)."""

    __slots__ = ("request_ids", "positions", "size")

    def __init__(self, request_ids: list[str], positions: list[int], size: int) -> None:
        self.request_ids, self.positions, self.size = request_ids, positions, size


class DecodeGraphs:
    """The decode forward captured per batch size (:meth:`capture`), its static inputs, and the mask graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
        parallel: ParallelGroups,
        captured_reader: CapturedSparseEntryReader | None,
        bitmask_argmax: OpImplementation | None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.parallel = parallel
        self.captured_reader = captured_reader
        """The reader a decode graph reads sparse entries through (its static buffers refilled before each replay)."""
        self.bitmask_argmax = bitmask_argmax
        self.logits_in_graph = parallel.layout.tensor_parallel_size == 1
        """Whether a captured decode graph includes the LM head (not when its all-gather cannot be captured)."""
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.logits: dict[int, torch.Tensor] = {}
        """Each decode graph's logits, as its capture returned them (what its replays write)."""
        self.mask_graphs: MaskGraphs | None = None
        self.static: StaticInputs | None = None
        self.scratch_blocks: list[int] = []
        self.max_model_len = 0
        self.staged: _Staged | None = None
        """A deferred step's decode-graph inputs, staged in the static buffers when it came (:meth:`stage_ahead`)."""
        self.split_from: int | None = None
        """The smallest captured size that runs as two nano-batches (None: every size runs whole)."""

    @torch.inference_mode()
    def capture(
        self,
        platform: Platform,
        sizes: Sequence[int],
        scratch_blocks: Sequence[int],
        max_model_len: int,
        split_from: int | None = None,
    ) -> float:
        """Capture the decode forward for each batch size (largest first); returns the seconds it took.

        ``scratch_blocks`` holds, per KV-cache group, a block id no request is
        ever given: padded rows write their keys and values there. ``split_from``: sizes from this one up run as
        two nano-batches (``engine.decode_overlap``, :mod:`weft.layers.nano_batches`); None: none do.
        """
        started = time.monotonic()
        self.scratch_blocks = list(scratch_blocks)
        self.split_from = split_from
        self.max_model_len = max_model_len
        widths = [-(-max_model_len // group.spec.block_size) for group in self.groups]
        self.static = StaticInputs(max(sizes), widths, self.device)
        self._rows = torch.arange(max(sizes))
        self._fill_padding(0, max(sizes))
        if self.captured_reader is not None:
            self.captured_reader.capture_rows(max(sizes), max_model_len)
        for size in sorted(set(sizes), reverse=True):
            self.graphs[size] = platform.capture_graph(lambda size=size: self._captured_forward(size))
        # The reference op (torch's ops) would hold [rows, vocab] tensors in the graph pool, sized after the KV cache:
        # only a fused op is captured on an accelerator (a CPU's "graphs" are replays, for tests).
        fused = self.bitmask_argmax is not None and (not self.bitmask_argmax.reference or self.device.type == "cpu")
        if fused and self.logits_in_graph and self.parallel.layout.pipeline_parallel_size == 1:
            largest = max(sizes)
            if largest not in self.logits:  # a platform that captured without calling the forward yet
                self._captured_forward(largest)
            self.mask_graphs = MaskGraphs(
                self.logits, self.bitmask_argmax, self.device, platform, sizes, self.logits[largest].shape[-1]
            )
        return time.monotonic() - started

    def _captured_forward(self, size: int) -> torch.Tensor:
        """:meth:`_static_forward`, its output kept for the mask graph of that size (the capture's call is the
        last: its output is what replays write)."""
        output = self._static_forward(size)
        if self.logits_in_graph:
            self.logits[size] = output
        return output

    def size_for(self, count: int) -> int | None:
        """The captured batch size a step of ``count`` decodes replays; None: none is large enough."""
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
            metadata.append(self.backend.build_metadata(batch) if group.spec.paged_attention else None)
        context = self._static_context(metadata, batches)
        if self.split_from is not None and size >= self.split_from:
            paged = [group.spec.paged_attention for group in self.groups]
            context.nano_batches = decode_nano_batches(self.backend, batches, paged, size, self._static_context)
        hidden = self.model(static.input_ids[:size], static.positions[:size], context)
        return self.model.compute_logits(hidden) if self.logits_in_graph else hidden

    def _static_context(self, metadata: list, batches: list[AttentionBatch]) -> ForwardContext:
        """A decode graph's forward context over ``batches`` (the step's, or a nano-batch's)."""
        return ForwardContext(
            backend=self.backend,
            metadata=metadata,
            kv_caches=self.kv_caches,
            batches=batches,
            static_decode=True,
            sparse_entries=self.captured_reader,
        )

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

    def stage_ahead(self, step: SchedulerOutput, requests: Mapping[str, RequestState]) -> None:
        """Stage the decode-graph inputs of a step deferred behind one that waits for its bitmask: positions,
        sequence lengths, block tables, slot mappings and padding, as its requests will be once it is taken in. The
        copies queue behind the forward already launched, which read the buffers before them. Stages nothing where
        the step would not replay a graph as staged here (a prefill, a new or finished request, ...)."""
        self.staged = None
        counts = step.num_scheduled_tokens
        if (
            not self.graphs
            or step.new_requests
            or step.finished_request_ids
            or self.parallel.layout.pipeline_parallel_size > 1
            or any(count != 1 for count in counts.values())
        ):
            return
        size = self.size_for(len(counts))
        if size is None:
            return
        cached = {entry.request_id: entry for entry in step.cached_requests}
        positions: list[int] = []
        tables: list[list[list[int]]] = [[] for _ in self.groups]
        for request_id in counts:
            state = requests[request_id]
            if state.prefix_hit is None or state.params.prompt_logprobs is not None:
                return  # resumes from a hit, or scores its prompt: it runs eagerly
            entry = cached.get(request_id)
            positions.append(state.num_computed_tokens if entry is None else entry.num_computed_tokens)
            for index, blocks in enumerate(state.block_ids):
                added = entry.new_block_ids[index] if entry is not None and entry.new_block_ids is not None else ()
                tables[index].append(blocks + list(added) if added else blocks)
        self._stage_replay(positions, tables, size)
        self.staged = _Staged(list(counts), positions, size)

    def stage(self, states: list[RequestState], size: int) -> None:
        """Stage the positions, sequence lengths, block tables and slot mappings of a replay of ``states`` at batch
        ``size`` (unless :meth:`stage_ahead` staged them already); the caller writes the token ids."""
        positions = [state.num_computed_tokens for state in states]
        staged, self.staged = self.staged, None
        if (
            staged is None
            or staged.size != size
            or staged.positions != positions
            or staged.request_ids != [state.request_id for state in states]
        ):
            tables = [[state.block_ids[index] for state in states] for index in range(len(self.groups))]
            self._stage_replay(positions, tables, size)

    def replay(self, states: list[RequestState], size: int) -> torch.Tensor:
        """Replay the graph of batch ``size`` over the staged inputs; the logits of the rows of ``states``."""
        count = len(states)
        if self.captured_reader is not None:
            self.captured_reader.prepare_rows([state.request_id for state in states], size)
        output = self.graphs[size]()
        return output[:count] if self.logits_in_graph else self.model.compute_logits(output[:count])

    def _stage_replay(self, positions: list[int], tables_by_group: list[list[list[int]]], size: int) -> None:
        """Copy a decode step's positions, sequence lengths, block tables and slot mappings (row ``i`` at position
        ``positions[i]``, its blocks ``tables_by_group[g][i]`` in group ``g``) into the static buffers, and pad the
        rest of the ``size`` rows."""
        static = self.static
        assert static is not None
        count = len(positions)
        # Staged on the host (a few microseconds of CPU ops), then one copy each: device-side
        # derivations would add kernel launches to every decode step.
        host_positions = torch.tensor(positions)
        static.positions[:count].copy_(host_positions, non_blocking=True)
        static.seq_lens[:count].copy_(host_positions + 1, non_blocking=True)
        for index, group in enumerate(self.groups):
            host_table = padded_tables(tables_by_group[index], static.block_tables[index].shape[1])
            static.block_tables[index][:count, : host_table.shape[1]].copy_(host_table, non_blocking=True)
            static.slot_mappings[index][:count].copy_(
                group.spec.slot_mapping(host_table, self._rows[:count], host_positions), non_blocking=True
            )
        if count < size:
            self._fill_padding(count, size)


def padded_tables(tables: Sequence[Sequence[int]], limit: int) -> torch.Tensor:
    """Block tables as one host ``[rows, width]`` int32 tensor, each padded with 0 to the longest, and at most
    ``limit`` (a static table's) columns: the blocks a request holds past ``max_model_len`` (slots allocated ahead of
    its tokens, ``k`` of them for a draft) hold no position a captured forward reads."""
    width = min(max(len(table) for table in tables), limit)
    flat = array("i")  # filled at C speed, then one copy to the device
    for table in tables:
        if len(table) >= width:
            flat.extend(table[:width])
        else:
            flat.extend(table)
            flat.extend(array("i", bytes(4 * (width - len(table)))))
    return torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width)


def verify_graph_sizes(decode_sizes: Sequence[int]) -> list[int]:
    """The batch sizes verify graphs are captured for, from the decode graphs': those up to 8, the multiples of 16
    and the largest (every step a decode graph fits, a verify graph fits too). Fewer than the decode graphs': a
    verify graph's activations are ``1 + k`` times a decode graph's and each capture costs a forward, while a step
    padded to the next multiple of 16 computes at most 15 rows' tokens more."""
    return sorted({size for size in decode_sizes if size <= 8 or size % 16 == 0} | {max(decode_sizes)})


class VerifyGraphs:
    """The forward of a speculating step captured per batch size (:meth:`capture`): up to ``size`` requests of at
    most ``1 + k`` query tokens each (a row's last token then its proposals, or one token for a row without any),
    laid end to end as the eager batch lays them, in a static ``tokens`` of ``min(size * (1 + k), token budget)``.

    A step of ``n`` requests replays the smallest captured size ``>= n`` (:func:`verify_graph_sizes`). Its real
    rows are exactly the eager batch (query starts, positions, sequence lengths, block tables and slots of its own
    tokens), so the attention launch and each real row's result are the eager step's; the rows past ``n`` are
    requests of no query token in the scratch blocks, and the tokens past the step's belong to no request: their
    keys and values go to the scratch block and their outputs are never read. The graph ends at the hidden states,
    copied into one static buffer (:attr:`hidden`) that every size writes: the LM head runs after the replay on the
    rows the step verifies, so no graph holds ``tokens x vocab`` logits in the memory pool.

    Only where every KV-cache group is paged attention (a model managing its groups reads ``static_decode`` batches
    of one token a row) and the attention backend captures such steps
    (:attr:`~weft.contracts.attention.AttentionBackend.supports_verify_graph_capture`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.tokens: dict[int, int] = {}
        """Each graph's static query tokens."""
        self.query_len = 0
        """The most query tokens of one row, ``1 + k``."""
        self.static: StaticInputs | None = None
        self.hidden: torch.Tensor | None = None
        """The hidden states every graph's replay writes (its first ``tokens`` rows), allocated by the first
        capture's warm-up call, outside the graphs' memory pool."""
        self.scratch_blocks: list[int] = []
        self.max_model_len = 0
        self.replays = 0
        """Steps that replayed a verify graph (the tests and bench/spec_decode.py read it)."""

    @torch.inference_mode()
    def capture(
        self,
        platform: Platform,
        sizes: Sequence[int],
        query_len: int,
        token_budget: int,
        scratch_blocks: Sequence[int],
        max_model_len: int,
    ) -> float:
        """Capture the verify forward for each batch size (largest first) with rows of up to ``query_len`` tokens
        and at most ``token_budget`` tokens a step; returns the seconds it took."""
        started = time.monotonic()
        self.scratch_blocks = list(scratch_blocks)
        self.max_model_len = max_model_len
        self.query_len = query_len
        self.tokens = {size: max(size, min(size * query_len, token_budget)) for size in sizes}
        largest = max(sizes)
        widths = [-(-max_model_len // group.spec.block_size) for group in self.groups]
        self.static = StaticInputs(largest, widths, self.device, self.tokens[largest])
        self._pad_rows(0, largest, 0)
        self._pad_tokens(0, self.tokens[largest])
        for size in sorted(set(sizes), reverse=True):
            self.graphs[size] = platform.capture_graph(lambda size=size: self._static_forward(size))
        return time.monotonic() - started

    def size_for(self, counts: list[int]) -> int | None:
        """The captured batch size a step of rows of ``counts`` query tokens replays; None: no graph fits it (more
        rows than the largest size, a row longer than ``1 + k``, more tokens than the size's)."""
        if not self.graphs or max(counts) > self.query_len:
            return None
        total = sum(counts)
        fitting = [size for size in self.graphs if size >= len(counts) and self.tokens[size] >= total]
        return min(fitting) if fitting else None

    def _static_forward(self, size: int) -> torch.Tensor:
        """The forward over the first ``size`` rows and ``tokens[size]`` tokens of the static buffers, its hidden
        states copied into :attr:`hidden`; what a graph captures."""
        static = self.static
        assert static is not None
        tokens = self.tokens[size]
        metadata, batches = [], []
        for index, group in enumerate(self.groups):
            batch = AttentionBatch(
                query_start=static.query_start[: size + 1],
                seq_lens=static.seq_lens[:size],
                block_table=static.block_tables[index][:size],
                slot_mapping=static.slot_mappings[index][:tokens],
                max_query_len=self.query_len,
                max_seq_len=self.max_model_len,
                block_size=group.spec.block_size,
            )
            batches.append(batch)
            metadata.append(self.backend.build_metadata(batch))
        context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
        hidden = self.model(static.input_ids[:tokens], static.positions[:tokens], context)
        if self.hidden is None:  # the first call, outside any graph (a capture's warm-up call runs first)
            self.hidden = hidden.new_empty(max(self.tokens.values()), *hidden.shape[1:])
        self.hidden[:tokens].copy_(hidden)
        return self.hidden

    def stage(self, states: list[RequestState], counts: list[int], size: int) -> None:
        """Copy a step's query starts, positions, sequence lengths, block tables and slot mappings (row ``i``:
        ``counts[i]`` tokens from its computed count) into the static buffers, and pad the rest of the graph's
        rows and tokens; the caller writes the token ids."""
        static = self.static
        assert static is not None
        count, total = len(states), sum(counts)
        starts = [state.num_computed_tokens for state in states]
        positions = [position for start, n in zip(starts, counts, strict=True) for position in range(start, start + n)]
        host_positions = torch.tensor(positions)
        host_counts = torch.tensor(counts)
        query_start = torch.zeros(count + 1, dtype=torch.int32)
        torch.cumsum(host_counts, 0, out=query_start[1:])
        static.query_start[: count + 1].copy_(query_start, non_blocking=True)
        static.positions[:total].copy_(host_positions, non_blocking=True)
        static.seq_lens[:count].copy_(torch.tensor(starts) + host_counts, non_blocking=True)
        rows = torch.repeat_interleave(torch.arange(count), host_counts)
        for index, group in enumerate(self.groups):
            tables = [state.block_ids[index] for state in states]
            host_table = padded_tables(tables, static.block_tables[index].shape[1])
            static.block_tables[index][:count, : host_table.shape[1]].copy_(host_table, non_blocking=True)
            static.slot_mappings[index][:total].copy_(
                group.spec.slot_mapping(host_table, rows, host_positions), non_blocking=True
            )
        self._pad_rows(count, size, total)
        self._pad_tokens(total, self.tokens[size])

    def replay(self, size: int, total: int) -> torch.Tensor:
        """Replay the graph of batch ``size`` over the staged inputs; the hidden states of the step's ``total``
        tokens."""
        self.replays += 1
        return self.graphs[size]()[:total]

    def _pad_rows(self, start: int, stop: int, total: int) -> None:
        """Make rows ``start:stop`` requests of no query token (their queries start where the step's tokens end)
        in the scratch blocks."""
        static = self.static
        assert static is not None
        static.query_start[start + 1 : stop + 1] = total
        static.seq_lens[start:stop] = 1
        for index in range(len(self.groups)):
            static.block_tables[index][start:stop] = self.scratch_blocks[index]

    def _pad_tokens(self, start: int, stop: int) -> None:
        """Make tokens ``start:stop`` tokens of no request: id 0 at position 0, their keys and values in the
        scratch block."""
        static = self.static
        assert static is not None
        static.input_ids[start:stop] = 0
        static.positions[start:stop] = 0
        for index, group in enumerate(self.groups):
            static.slot_mappings[index][start:stop] = self.scratch_blocks[index] * group.spec.block_size


class MaskGraphs:
    """Per decode-graph size, a graph of the ``bitmask_argmax`` op over that decode graph's logits, and the
    buffers it reads: the rows' mask indices (-1: unmasked) then the bitmask words, staged in pinned memory and
    copied to the device in one copy before each replay."""

    def __init__(
        self,
        graph_logits: Mapping[int, torch.Tensor],
        bitmask_argmax: OpImplementation,
        device: torch.device,
        platform: Platform,
        sizes: Sequence[int],
        vocab: int,
    ) -> None:
        """``graph_logits``: each decode graph's logits, which its replays write (:attr:`DecodeGraphs.logits`)."""
        self.graph_logits = graph_logits
        self.bitmask_argmax = bitmask_argmax
        self.words = -(-vocab // 32)
        largest = max(sizes)
        self.offset = _words_at(largest)
        """Where the bitmask words start in the buffers (16-byte aligned, as the kernel is compiled)."""
        size = self.offset + largest * self.words
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.outputs = {size: torch.zeros(2, size, dtype=torch.long, device=device) for size in set(sizes)}
        """Per graph, its rows' tokens then statuses (what the copy to the host takes, as it is): outside the graphs'
        memory pool, which a decode graph's replay may reuse for its own work."""
        accelerated = device.type != "cpu"
        self.host = torch.empty(size, dtype=torch.int32, pin_memory=accelerated)
        self._copied = torch.Event(device=device) if accelerated else None
        self._copying = False
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        for batch in sorted(set(sizes), reverse=True):  # the largest first, as the decode graphs
            self.graphs[batch] = platform.capture_graph(lambda batch=batch: self._masked_greedy(batch))

    def _masked_greedy(self, size: int) -> torch.Tensor:
        """What a graph captures: row ``i``'s greedy token under its mask, and its status, as ``[2, size]``."""
        logits = self.graph_logits[size]
        words = self.device_buffer[self.offset :].view(-1, self.words)[:size]
        tokens, healthy = self.bitmask_argmax(logits, self.device_buffer[:size], words)
        output = self.outputs[size]
        output[0].copy_(tokens)
        output[1].copy_(greedy_status(healthy))
        return output

    def fits(self, rows: list[int], bitmask: bytes) -> bool:
        """Whether ``bitmask`` has this graph's row width (one sized for a wider vocabulary takes the unfused path)."""
        return len(bitmask) == len(rows) * self.words * 4

    def sample(self, size: int, count: int, rows: list[int], bitmask: bytes) -> SampledBatch:
        """The first ``count`` rows' tokens (bitmask row ``i`` masks logits row ``rows[i]``, :meth:`fits`), views of
        :attr:`outputs`, valid until that graph's next replay: the next step reads them (its inputs; their copy
        to the host is queued at once) before it samples."""
        masked = len(rows)
        if not self.fits(rows, bitmask):
            raise ValueError(
                f"the grammar bitmask holds {len(bitmask) // 4} int32 words for {masked} rows; "
                f"the logits need {self.words} a row"
            )
        if self._copying:
            self._copied.synchronize()  # type: ignore[union-attr]  # the last copy has left the buffer
        end = self.offset + masked * self.words
        host = self.host.numpy()
        host[:size] = mask_rows_of(size, rows)
        host[self.offset : end] = numpy.frombuffer(bitmask, dtype=numpy.int32)
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
            self._copying = True
        packed = self.graphs[size]()  # [2, size]: copied whole (contiguous), the padding rows dropped on the host
        return SampledBatch(packed[0, :count], packed[1, :count], packed=packed)
