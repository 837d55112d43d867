"""A step's requests as DeepSeek V4's layers read them: the prefilling requests padded into one batch,
the one-token (decoding) requests gathered into one batch, and the cache tensors by layer."""

from __future__ import annotations

import functools
from typing import Any

import torch

from weft.api import ForwardContext


class RequestRows:
    """One request's slice of the step: its index in the step's batch, rows, and positions ``start .. end - 1``."""

    def __init__(self, index: int, row_start: int, row_end: int, end: int) -> None:
        self.index, self.row_start, self.row_end = index, row_start, row_end
        self.start, self.end = end - (row_end - row_start), end


class StepLayout:
    """The step's requests (from the runner's per-group batches) and the cache tensors by layer."""

    def __init__(
        self, context: ForwardContext, group_names: tuple[str, ...], ring_blocks: int, decode_width_tokens: int = 0
    ) -> None:
        batches = dict(zip(group_names, context.batches, strict=False))
        first = batches["window"]
        self.caches = context.kv_caches
        self.request_ids = context.request_ids
        self.sparse_entries = context.sparse_entries
        """Where the selected entries of lent ``csa_kv`` blocks are read (a KV connector's reader), or None."""
        self.ring_blocks = ring_blocks
        checkpoints = batches.get("window_checkpoint")
        self.checkpoint_unit = checkpoints.block_size if checkpoints is not None else 0
        """Tokens between two snapshots of the window ring and compressor state (0: prefix caching off)."""
        self.batches = batches
        """Each group's batch of the step, by group name."""
        self._prefill_batch: PrefillBatch | None = None
        if context.static_decode:
            # A decode graph's forward: every row decodes, nothing is read on the host.
            self.restores: list[tuple[int, dict[str, torch.Tensor]]] = []
            self.prefills: list[RequestRows] = []
            self.decode: DecodeBatch | None = DecodeBatch.static(batches)
            return
        starts = first.query_start.tolist()
        lengths = first.seq_lens.tolist()
        self.restores = [
            (hit, {name: batch.block_table[index].long() for name, batch in batches.items()})
            for index, hit in enumerate(context.prefix_hits)
            if self.checkpoint_unit and hit and hit % self.checkpoint_unit == 0
        ]
        """``(tokens found cached, the request's blocks per group)`` of each request resuming from a prefix hit.
        A transferred prefix (a prefill/decode transfer) came with the ring and state themselves: the runner
        reports no hit for it (``NewRequest.state_transferred``)."""
        decoding = [index for index in range(len(lengths)) if starts[index + 1] - starts[index] == 1]
        self.prefills = [
            RequestRows(index, starts[index], starts[index + 1], lengths[index])
            for index in range(len(lengths))
            if starts[index + 1] - starts[index] != 1
        ]
        self.decode = DecodeBatch.of_step(decoding, starts, lengths, batches, decode_width_tokens) if decoding else None

    def boundaries(self, start: int, end: int) -> list[int]:
        """The snapshot boundaries tokens ``start .. end - 1`` cross (none without prefix caching)."""
        unit = self.checkpoint_unit
        return list(range((start // unit + 1) * unit, end + 1, unit)) if unit else []

    def prefill_batch(self, window: int) -> PrefillBatch:
        """The prefilling requests padded into one batch (built once a step; every layer has the same window)."""
        if self._prefill_batch is None:
            self._prefill_batch = PrefillBatch(self, window)
        return self._prefill_batch


class PrefillBatch:
    """Every prefilling request of the step padded to ``[requests, rows]`` queries and ``[requests, keys]``
    window keys (positions ``start - window + 1 .. end - 1``), with the index tensors a layer needs to read
    and write its ring and window snapshots in one operation each."""

    def __init__(self, step: StepLayout, window: int) -> None:
        prefills = step.prefills
        ring = step.batches["window"]
        device = ring.block_table.device
        size, ring_blocks = ring.block_size, step.ring_blocks
        index = torch.tensor([request.index for request in prefills], device=device)
        starts = torch.tensor([request.start for request in prefills], device=device)
        ends = torch.tensor([request.end for request in prefills], device=device)
        row_starts = torch.tensor([request.row_start for request in prefills], device=device)
        firsts = (starts - window + 1).clamp(min=0)
        self.index, self.starts, self.ends, self.row_starts = index, starts, ends, row_starts
        """Each prefilling request's row of the step's batch, first and end positions, and first row."""
        self.firsts = firsts
        """Each request's first window key's position (its key ``j`` is position ``firsts + j``)."""
        state = step.batches.get("compressor_state")
        self.state_blocks = state.block_table[index, 0].long() if state is not None else None
        longest_query = max(request.end - request.start for request in prefills)
        longest_keys = max(request.end - max(0, request.start - window + 1) for request in prefills)
        offsets = torch.arange(longest_query, device=device)
        padding = longest_query - (ends - starts)
        self.query_valid = offsets[None, :] >= padding[:, None]
        self.query_rows = torch.where(self.query_valid, row_starts[:, None] + offsets - padding[:, None], 0)
        """Each padded query's row of the step (0 for padding: ``query_valid`` says which are real). Padding comes
        first, so each request's last query is the batch's last column (as ``decode_topk`` reads rows)."""
        self.query_indices = torch.arange(self.query_valid.numel(), device=device)[self.query_valid.flatten()]
        """The real queries' indices ``request * rows + column`` into the padded batch, in the step's row order."""
        self.query_positions = ends[:, None] - longest_query + offsets
        key_positions = firsts[:, None] + torch.arange(longest_keys, device=device)
        self.key_positions = key_positions
        """``[requests, keys]``: each request's window keys' positions (past ``ends - 1``: padding)."""
        key_valid = key_positions < ends[:, None]
        self.from_ring = key_positions < starts[:, None]
        """Keys of positions before the step, read from the ring; the others are the step's own rows."""
        tables = ring.block_table[index].long()
        ring_positions = key_positions.clamp(max=(ends - 1)[:, None])
        self.ring_slots = tables.gather(1, (ring_positions // size) % ring_blocks) * size + ring_positions % size
        self.new_rows = (row_starts[:, None] + key_positions - starts[:, None]).clamp(min=0)
        self.new_rows = torch.where(key_valid & ~self.from_ring, self.new_rows, 0)
        self.window = window
        # The ring keeps the last ring_blocks * size keys of each request's step.
        kept_count = (ends - starts).clamp(max=ring_blocks * size)
        kept_positions = ends[:, None] - kept_count.max() + torch.arange(int(kept_count.max()), device=device)
        kept = kept_positions >= (ends - kept_count)[:, None]
        kept_positions = kept_positions.clamp(min=0)
        slots = tables.gather(1, (kept_positions // size) % ring_blocks) * size + kept_positions % size
        self.write_slots = slots[kept]
        self.write_rows = (row_starts[:, None] + kept_positions - starts[:, None])[kept]
        # Window snapshots: at each boundary B a request crosses, the keys of positions B - window .. B - 1.
        pairs = [
            (number, boundary)
            for number, request in enumerate(prefills)
            for boundary in step.boundaries(request.start, request.end)
        ]
        self.snapshot_block = self.snapshot_offset = self.snapshot_request = self.snapshot_key = None
        self.boundary_requests = torch.tensor([number for number, _ in pairs], dtype=torch.long, device=device)
        self.boundaries = torch.tensor([boundary for _, boundary in pairs], dtype=torch.long, device=device)
        """Each (request, boundary crossed) pair of the step, for the snapshots of the window and compressor state."""
        self.boundary_snapshot_blocks = None
        if pairs and "state_checkpoint" in step.batches:
            state_tables = step.batches["state_checkpoint"].block_table[index].long()
            self.boundary_snapshot_blocks = state_tables[
                self.boundary_requests, self.boundaries // step.checkpoint_unit - 1
            ]
        if pairs:
            numbers = torch.tensor([number for number, _ in pairs], device=device)
            boundaries = torch.tensor([boundary for _, boundary in pairs], device=device)
            offsets = torch.arange(window, device=device).expand(len(pairs), -1)
            positions = boundaries[:, None] - window + offsets
            valid = positions >= 0
            checkpoint_tables = step.batches["window_checkpoint"].block_table[index].long()
            blocks = checkpoint_tables[numbers, boundaries // step.checkpoint_unit - 1]
            self.snapshot_block = blocks[:, None].expand(-1, window)[valid]
            self.snapshot_offset = offsets[valid]
            self.snapshot_request = numbers[:, None].expand(-1, window)[valid]
            self.snapshot_key = (positions - firsts[numbers][:, None])[valid]

    @functools.cached_property
    def window_bias(self) -> torch.Tensor:
        """``[requests, rows, keys]``: each query sees the keys of the last ``window`` positions up to its own.
        Built on first use: only the einsum path reads it (the Triton kernel computes it from the positions)."""
        distance = self.query_positions[:, :, None] - self.key_positions[:, None, :]
        key_valid = self.key_positions < self.ends[:, None]
        hidden = (distance < 0) | (distance >= self.window) | ~key_valid[:, None, :] | ~self.query_valid[:, :, None]
        return torch.zeros(distance.shape, dtype=torch.float32, device=distance.device).masked_fill_(
            hidden, float("-inf")
        )


class DecodeBatch:
    """The step's one-token requests, gathered so that each layer handles them together."""

    def __init__(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        position_list: list[int] | None,
        tables: dict[str, torch.Tensor],
        indices: list[int],
        full_width: bool,
    ) -> None:
        self.rows, self.positions = rows, positions
        """Each decoding row's row of the step, and its position."""
        self.position_list = position_list
        """The positions on the host; None in a decode graph, where only ``positions`` exists."""
        self.tables = tables
        """Each group's block table of the decoding rows (``long``)."""
        state = tables.get("compressor_state")
        self.state_blocks = state[:, 0] if state is not None else None
        self.indices = indices
        """Each decoding row's index in the step's batch (empty in a decode graph)."""
        self.full_width = full_width
        """Whether the tables are padded to every block ``max_model_len`` allows, as a decode graph's are (then
        layers read every entry the table can address, masked past each request's count: the shapes, and so
        the arithmetic, of a graph's decode)."""

    @classmethod
    def of_step(
        cls, indices: list[int], starts: list[int], lengths: list[int], batches: dict[str, Any], width_tokens: int = 0
    ) -> DecodeBatch:
        """The step's rows ``indices`` (eager); with ``width_tokens``, tables padded to that many tokens' blocks."""
        device = batches["window"].block_table.device
        chosen = torch.tensor(indices, device=device)
        position_list = [lengths[index] - 1 for index in indices]
        tables = {}
        for name, batch in batches.items():
            table = batch.block_table[chosen].long()
            if width_tokens:
                table = torch.nn.functional.pad(
                    table, (0, max(0, -(-width_tokens // batch.block_size) - table.shape[1]))
                )
            tables[name] = table
        return cls(
            torch.tensor([starts[index] for index in indices], device=device),
            torch.tensor(position_list, device=device),
            position_list,
            tables,
            indices,
            bool(width_tokens),
        )

    @classmethod
    def static(cls, batches: dict[str, Any]) -> DecodeBatch:
        """Every row of a decode graph's static buffers, read on the device only."""
        first = batches["window"]
        rows = torch.arange(first.seq_lens.shape[0], device=first.seq_lens.device)
        tables = {name: group.block_table.long() for name, group in batches.items()}
        return cls(rows, first.seq_lens.long() - 1, None, tables, [], True)

    def completing(self, every: int) -> torch.Tensor | None:
        """The rows whose token completes a span of ``every`` positions (a compressed entry, a snapshot), or None
        when none does; in a decode graph every row, whose writes then go through :meth:`or_scratch`."""
        if self.position_list is None:
            return self.rows
        rows = [row for row, position in enumerate(self.position_list) if (position + 1) % every == 0]
        return torch.tensor(rows, device=self.rows.device) if rows else None

    def or_scratch(self, rows: torch.Tensor, every: int, targets: torch.Tensor, scratch: int) -> torch.Tensor:
        """Where :meth:`completing` ``rows`` write: ``targets``, except, in a decode graph, ``scratch`` (a slot of the
        cache's scratch block, its last) for a row whose token completes no span."""
        if self.position_list is not None:
            return targets
        return torch.where((self.positions[rows] + 1) % every == 0, targets, scratch)
