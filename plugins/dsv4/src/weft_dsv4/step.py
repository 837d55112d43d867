"""A step's requests as DeepSeek V4's layers read them: prefilling requests one by one, the
one-token (decoding) requests gathered into one batch, and the cache tensors by layer."""

from __future__ import annotations

from typing import Any

import torch

from weft.layers.attention import ForwardContext

class RequestRows:
    """One request's slice of the step: rows, positions ``start .. end - 1``, and its blocks per group."""

    def __init__(self, index: int, row_start: int, row_end: int, end: int, tables: dict[str, torch.Tensor], ring_blocks: int) -> None:
        self.index, self.row_start, self.row_end = index, row_start, row_end
        self.start, self.end = end - (row_end - row_start), end
        self.tables = tables
        self.window_table = tables["window"]
        self.ring_blocks = ring_blocks
        state = tables.get("compressor_state")
        self.state_block = int(state[0]) if state is not None else -1


class StepLayout:
    """The step's requests (from the runner's per-group batches) and the cache tensors by layer."""

    def __init__(self, context: ForwardContext, group_names: tuple[str, ...], ring_blocks: int) -> None:
        batches = dict(zip(group_names, context.batches))
        first = batches["window"]
        starts = first.query_start.tolist()
        lengths = first.seq_lens.tolist()
        self.caches = context.kv_caches
        self.request_ids = context.request_ids
        self.sparse_entries = context.sparse_entries
        """Where the selected entries of lent ``csa_kv`` blocks are read (a KV connector's reader), or None."""
        self.ring_blocks = ring_blocks
        checkpoints = batches.get("window_checkpoint")
        self.checkpoint_unit = checkpoints.block_size if checkpoints is not None else 0
        """Tokens between two snapshots of the window ring and compressor state (0: prefix caching off)."""
        self.restores = [
            (hit, {name: batch.block_table[index].long() for name, batch in batches.items()})
            for index, hit in enumerate(context.prefix_hits) if self.checkpoint_unit and hit and hit % self.checkpoint_unit == 0
        ]
        """``(tokens found cached, the request's blocks per group)`` of each request resuming from a prefix hit.
        A transferred prefix (a prefill/decode transfer) came with the ring and state themselves: the runner
        reports no hit for it (``NewRequest.state_transferred``)."""
        decoding = [index for index in range(len(lengths)) if starts[index + 1] - starts[index] == 1]
        self.prefills = [
            RequestRows(
                index, starts[index], starts[index + 1], lengths[index],
                {name: batch.block_table[index].long() for name, batch in batches.items()}, ring_blocks,
            )
            for index in range(len(lengths))
            if starts[index + 1] - starts[index] != 1
        ]
        self.decode = DecodeBatch(decoding, starts, lengths, batches) if decoding else None


class DecodeBatch:
    """The step's one-token requests, gathered so that each layer handles them together."""

    def __init__(self, indices: list[int], starts: list[int], lengths: list[int], batches: dict[str, Any]) -> None:
        device = batches["window"].block_table.device
        chosen = torch.tensor(indices, device=device)
        self.rows = torch.tensor([starts[index] for index in indices], device=device)
        self.position_list = [lengths[index] - 1 for index in indices]
        self.positions = torch.tensor(self.position_list, device=device)
        self.tables = {name: batch.block_table[chosen].long() for name, batch in batches.items()}
        state = self.tables.get("compressor_state")
        self.state_blocks = state[:, 0] if state is not None else None
        self.lengths = lengths
        """Each decoding request's length after this token, by step row (``lengths[index]``)."""
        self.indices = indices
