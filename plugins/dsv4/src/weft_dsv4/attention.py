"""DeepSeek V4 attention: shared-KV MQA over a sliding window ring plus, on CSA and HCA layers,
compressed entries (CSA: the indexer's top-k; HCA: every visible one), with a per-head sink in the
softmax and a grouped low-rank output projection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weft.contracts.loader import WeightSlice, as_slice
from weft.layers.linear import Linear
from weft.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, Shard, copy_checked
from weft_dsv4.compressor import Compressor, write_and_read_entries
from weft_dsv4.config import CSA, SLIDING, DeepseekV4Settings, layer_groups
from weft_dsv4.indexer import Indexer
from weft_dsv4.norm import RMSNorm, unweighted_rms_norm
from weft_dsv4.rope import InterleavedRope, apply_rope
from weft_dsv4.step import RequestRows, StepLayout

class DeepseekV4Attention(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.settings = s
        self.index = index
        self.kind = s.layer_types[index]
        self.num_heads, self.head_dim, self.window = s.local_heads, s.head_dim, s.sliding_window
        self.rope_name = "main" if self.kind == SLIDING else "compress"
        rank = s.layout.tensor_rank
        self.q_a_proj = Linear(s.hidden_size, s.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        heads = Shard(rank * s.local_heads, s.local_heads)
        self.q_b_proj = ColumnParallelLinear(s.q_lora_rank, [Shard(heads.start * s.head_dim, heads.length * s.head_dim)], bias=False)
        self.kv_proj = Linear(s.hidden_size, s.head_dim, bias=False)
        self.kv_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        # Grouped low-rank output: each of o_groups head groups to o_lora_rank, then one mix.
        groups = Shard(rank * s.local_groups * s.o_lora_rank, s.local_groups * s.o_lora_rank)
        self.o_a_proj = ColumnParallelLinear(s.num_heads * s.head_dim // s.o_groups, [groups], bias=False)
        self.o_b_proj = RowParallelLinear(groups, s.hidden_size, bias=False)
        self.heads = heads
        self.sinks = nn.Parameter(torch.empty(s.local_heads, dtype=torch.float32))
        self.compressor = None
        self.indexer = None
        if self.kind != SLIDING:
            self.compressor = Compressor(s.hidden_size, s.head_dim, s.ratio(self.kind), self.kind == CSA, s.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(s)
        self.cache_names = {group: f"model.layers.{index}.self_attn.{group}" for group in layer_groups(self.kind)}
        self.topk_op: Any = None
        """The ``decode_topk`` op implementation, set by the family at build time."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, ropes: dict[str, InterleavedRope], step: StepLayout) -> torch.Tensor:
        s = self.settings
        tokens, dtype = hidden.shape[0], hidden.dtype
        cos, sin = ropes[self.rope_name].table(positions, dtype)
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        query = self.q_b_proj(q_residual).view(tokens, self.num_heads, self.head_dim)
        query = apply_rope(unweighted_rms_norm(query, s.rms_norm_eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(hidden)), cos, sin)
        output = torch.empty_like(query)
        if step.decode is not None:
            output[step.decode.rows] = self._decode(query, kv, hidden, q_residual, ropes["compress"], step)
        compressed = self._compress(hidden, q_residual, positions, ropes["compress"], step)
        ring = step.caches[self.cache_names["window"]]
        for request in step.prefills:
            rows = slice(request.row_start, request.row_end)
            keys, key_positions = self._window_keys(ring, request, kv[rows])
            self._snapshot_window(step, request, keys)
            query_positions = positions[rows]
            distance = query_positions.view(-1, 1) - key_positions.view(1, -1)
            window_bias = torch.zeros(distance.shape, dtype=torch.float32, device=hidden.device)
            window_bias.masked_fill_((distance < 0) | (distance >= self.window), float("-inf"))
            entries, entry_bias = compressed[request.index] if compressed is not None else (None, None)
            output[rows] = self._attend(query[rows], keys, window_bias, entries, entry_bias)
        output = apply_rope(output, cos, -sin)
        grouped = output.reshape(tokens, s.local_groups, -1)
        weight = self.o_a_proj.weight.view(s.local_groups, s.o_lora_rank, -1)
        mixed = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(tokens, -1)
        return self.o_b_proj(mixed)

    def load_checkpoint_tensor(self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0) -> None:
        """The sinks of this rank's heads."""
        copy_checked(getattr(self, parameter).data, as_slice(weight).narrow(0, self.heads.start, self.heads.length), name)

    def restore(self, step: StepLayout, hit: int, tables: dict[str, torch.Tensor]) -> None:
        """Resume a request from a prefix hit of ``hit`` tokens: its window ring and compressor state
        become the snapshots taken after token ``hit - 1``."""
        block = hit // step.checkpoint_unit - 1
        ring = step.caches[self.cache_names["window"]]
        size = ring.shape[1]
        snapshot = step.caches[self.cache_names["window_checkpoint"]][int(tables["window_checkpoint"][block])].view(self.window, -1)
        positions = torch.arange(max(hit - self.window, 0), hit, device=ring.device)
        slots = tables["window"][(positions // size) % step.ring_blocks] * size + positions % size
        ring.view(-1, ring.shape[-1])[slots] = snapshot[positions - (hit - self.window)]
        if self.compressor is not None:
            saved = step.caches[self.cache_names["state_checkpoint"]][int(tables["state_checkpoint"][block])]
            step.caches[self.cache_names["compressor_state"]][int(tables["compressor_state"][0])] = saved

    def _boundaries(self, step: StepLayout, start: int, end: int) -> list[int]:
        """The snapshot boundaries a request's tokens ``start .. end - 1`` cross (none without prefix caching)."""
        unit = step.checkpoint_unit
        return list(range((start // unit + 1) * unit, end + 1, unit)) if unit else []

    def _snapshot_window(self, step: StepLayout, request: RequestRows, keys: torch.Tensor) -> None:
        """Snapshot the last ``window`` keys at each boundary the request crosses; ``keys`` holds
        positions ``max(0, start - window + 1) .. end - 1``."""
        first = max(0, request.start - self.window + 1)
        snapshots = step.caches.get(self.cache_names["window_checkpoint"])
        for boundary in self._boundaries(step, request.start, request.end):
            target = snapshots[int(request.tables["window_checkpoint"][boundary // step.checkpoint_unit - 1])]
            positions = torch.arange(max(boundary - self.window, 0), boundary, device=keys.device)
            target.view(self.window, -1)[positions - (boundary - self.window)] = keys[positions - first]

    def _window_keys(self, ring: torch.Tensor, request: RequestRows, new_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of positions ``start - window + 1 .. end - 1`` (earlier ones from the ring); stores the new ones."""
        spec_blocks, size = request.ring_blocks, ring.shape[1]
        flat = ring.view(-1, ring.shape[-1])
        first = max(0, request.start - self.window + 1)
        old = torch.arange(first, request.start, device=new_keys.device)
        table = request.window_table
        old_slots = table[(old // size) % spec_blocks] * size + old % size
        keys = torch.cat([flat[old_slots], new_keys])
        keep = min(new_keys.shape[0], spec_blocks * size)
        new = torch.arange(request.end - keep, request.end, device=new_keys.device)
        flat[table[(new // size) % spec_blocks] * size + new % size] = new_keys[new_keys.shape[0] - keep :]
        return keys, torch.arange(first, request.end, device=new_keys.device)

    def _attend(
        self, query: torch.Tensor, keys: torch.Tensor, window_bias: torch.Tensor,
        entries: torch.Tensor | None, entry_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Softmax over window keys, compressed entries and the per-head sink; keys are also the values."""
        scale = self.head_dim**-0.5
        logits = (torch.einsum("thd,kd->htk", query, keys) * scale).float() + window_bias
        if entries is not None:
            if entries.dim() == 3:  # per-query selections [rows, k, d]
                entry_logits = torch.einsum("thd,tkd->htk", query, entries)
            else:
                entry_logits = torch.einsum("thd,kd->htk", query, entries)
            entry_logits = (entry_logits * scale).float() + entry_bias
            logits = torch.cat([logits, entry_logits], dim=-1)
        sinks = self.sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1].to(query.dtype)
        output = torch.einsum("htk,kd->thd", probs[..., : keys.shape[0]], keys)
        if entries is not None:
            entry_probs = probs[..., keys.shape[0] :]
            if entries.dim() == 3:
                output = output + torch.einsum("htk,tkd->thd", entry_probs, entries)
            else:
                output = output + torch.einsum("htk,kd->thd", entry_probs, entries)
        return output

    def _decode(
        self, query: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, q_residual: torch.Tensor,
        rope: InterleavedRope, step: StepLayout,
    ) -> torch.Tensor:
        """Every one-token request of the step at once: window keys, new entries, indexer picks, attention."""
        batch = step.decode
        rows, positions = batch.rows, batch.positions
        ring = step.caches[self.cache_names["window"]]
        size, dim = ring.shape[1], ring.shape[2]
        flat = ring.view(-1, dim)
        table = batch.tables["window"]

        def ring_slots(at: torch.Tensor) -> torch.Tensor:
            return table.gather(1, (at // size) % step.ring_blocks) * size + at % size

        flat[ring_slots(positions[:, None])[:, 0]] = kv[rows]
        window = positions[:, None] - self.window + 1 + torch.arange(self.window, device=kv.device)
        keys = flat[ring_slots(window.clamp(min=0))]
        at_boundary = [row for row, position in enumerate(batch.position_list)
                       if step.checkpoint_unit and (position + 1) % step.checkpoint_unit == 0]
        if at_boundary:
            # The window keys of positions p - window + 1 .. p are this boundary's snapshot.
            chosen = torch.tensor(at_boundary, device=kv.device)
            blocks = self._snapshot_blocks(step, chosen, "window_checkpoint")
            step.caches[self.cache_names["window_checkpoint"]][blocks] = keys[chosen].flatten(1)
        bias = torch.zeros(window.shape, dtype=torch.float32, device=kv.device).masked_fill_(window < 0, float("-inf"))
        if self.compressor is not None:
            m = self.compressor.ratio
            entry_group = "csa_kv" if self.kind == CSA else "hca_kv"
            state = step.caches[self.cache_names["compressor_state"]]
            main = self.compressor.state_elements()
            entries, visible = self.compressor.decode_step(
                hidden[rows], batch, state[:, :main], step.caches[self.cache_names[entry_group]], batch.tables[entry_group], rope,
            )
            if self.indexer is None:
                picked, picked_bias = entries, torch.zeros(visible.shape, dtype=torch.float32, device=kv.device)
                picked_bias.masked_fill_(~visible, float("-inf"))
            else:
                index_state = state[:, main : main + self.indexer.compressor.state_elements()]
                index_keys, _ = self.indexer.compressor.decode_step(
                    hidden[rows], batch, index_state, step.caches[self.cache_names["indexer_keys"]], batch.tables["indexer_keys"], rope,
                )
                cos, sin = rope.table(positions, hidden.dtype)
                index_query = self.indexer.q_b_proj(q_residual[rows]).view(-1, self.indexer.num_heads, self.indexer.head_dim)
                index_query = apply_rope(index_query, cos, sin)
                index_weights = self.indexer.weights_proj(hidden[rows]).float() * self.indexer.num_heads**-0.5
                scores = self.indexer.row_scores(index_query, index_weights, index_keys)
                # Row t sees entries w < (t + 1) // m: the op's "blocks of m positions up to pos" shifted by m - 1.
                seq_lens = (positions + 1 - (m - 1)).to(torch.int32)
                picks = self.topk_op(scores.unsqueeze(0), seq_lens, 1, m, self.indexer.topk)[0].long()
                if entries.shape[1]:
                    picked = entries.gather(1, picks.clamp(min=0).unsqueeze(-1).expand(-1, -1, entries.shape[-1]))
                else:
                    picked = entries.new_zeros((*picks.shape, entries.shape[-1]))
                picked_bias = torch.zeros(picks.shape, dtype=torch.float32, device=kv.device).masked_fill_(picks < 0, float("-inf"))
                if step.sparse_entries is not None:  # a KV connector holds entries of lent blocks (weft-hisparse)
                    request_ids = [step.request_ids[index] for index in batch.indices]
                    picked = step.sparse_entries.read(self.cache_names[entry_group], request_ids, picks, picked)
            if at_boundary:
                blocks = self._snapshot_blocks(step, chosen, "state_checkpoint")
                step.caches[self.cache_names["state_checkpoint"]][blocks] = state[batch.state_blocks[chosen]]
            keys = torch.cat([keys, picked], dim=1)
            bias = torch.cat([bias, picked_bias], dim=1)
        return self._attend_rows(query[rows], keys, bias)

    def _snapshot_blocks(self, step: StepLayout, chosen: torch.Tensor, group: str) -> torch.Tensor:
        """The snapshot blocks of decoding rows ``chosen``, each at the boundary its token completes."""
        batch = step.decode
        index = (batch.positions[chosen] + 1) // step.checkpoint_unit - 1
        return batch.tables[group][chosen].gather(1, index[:, None])[:, 0]

    def _attend_rows(self, query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Each row's own keys (``[rows, keys, d]``, also the values) with the per-head sink in the softmax."""
        logits = (torch.einsum("bhd,bkd->hbk", query, keys) * self.head_dim**-0.5).float() + bias
        sinks = self.sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1].to(query.dtype)
        return torch.einsum("hbk,bkd->bhd", probs, keys)

    def _compress(
        self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, rope: InterleavedRope, step: StepLayout
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
        """Per prefilling request: its compressed entries (all, or the indexer's picks per query) and their bias."""
        if self.compressor is None or not step.prefills:
            return None
        m = self.compressor.ratio
        kv, gate = self.compressor.project(hidden, positions)
        state = step.caches[self.cache_names["compressor_state"]]
        entry_cache = step.caches[self.cache_names["csa_kv" if self.kind == CSA else "hca_kv"]]
        entry_table = "csa_kv" if self.kind == CSA else "hca_kv"
        if self.indexer is not None:
            index_kv, index_gate = self.indexer.compressor.project(hidden, positions)
            index_keys_cache = step.caches[self.cache_names["indexer_keys"]]
            cos, sin = rope.table(positions, hidden.dtype)
            index_query = self.indexer.q_b_proj(q_residual).view(-1, self.indexer.num_heads, self.indexer.head_dim)
            index_query = apply_rope(index_query, cos, sin)
            index_weights = self.indexer.weights_proj(hidden).float() * self.indexer.num_heads**-0.5
        results = {}
        for request in step.prefills:
            rows = slice(request.row_start, request.row_end)
            layer_state = state[request.state_block]
            main_state = layer_state[: self.compressor.state_elements()].view(self.compressor.span, -1)
            boundaries = self._boundaries(step, request.start, request.end)
            snapshots = [
                step.caches[self.cache_names["state_checkpoint"]][int(request.tables["state_checkpoint"][boundary // step.checkpoint_unit - 1])]
                for boundary in boundaries
            ]
            first, new = self.compressor.step(
                kv[rows], gate[rows], request.start, main_state, rope,
                [(boundary, snapshot[: self.compressor.state_elements()].view(self.compressor.span, -1))
                 for boundary, snapshot in zip(boundaries, snapshots)],
            )
            entries = write_and_read_entries(entry_cache, request.tables[entry_table], first, new, request.end // m, m)
            query_positions = positions[rows]
            visible = (query_positions + 1) // m
            if self.indexer is None:
                bias = torch.zeros((query_positions.numel(), entries.shape[0]), dtype=torch.float32, device=hidden.device)
                bias.masked_fill_(torch.arange(entries.shape[0], device=hidden.device).view(1, -1) >= visible.view(-1, 1), float("-inf"))
                results[request.index] = (entries, bias)
                continue
            index_state = layer_state[self.compressor.state_elements() :][: self.indexer.compressor.state_elements()]
            index_state = index_state.view(self.indexer.compressor.span, -1)
            main = self.compressor.state_elements()
            index_snapshots = [
                (boundary, snapshot[main:][: self.indexer.compressor.state_elements()].view(self.indexer.compressor.span, -1))
                for boundary, snapshot in zip(boundaries, snapshots)
            ]
            first, new_keys = self.indexer.compressor.step(
                index_kv[rows], index_gate[rows], request.start, index_state, rope, index_snapshots,
            )
            keys = write_and_read_entries(index_keys_cache, request.tables["indexer_keys"], first, new_keys, request.end // m, m)
            scores = self.indexer.scores(index_query[rows], index_weights[rows], keys)
            # Row t sees entries w < (t + 1) // m: the op's "blocks of m positions up to pos" shifted by m - 1.
            seq_lens = torch.tensor([request.end - (m - 1)], dtype=torch.int32, device=hidden.device)
            picks = self.topk_op(scores.unsqueeze(0), seq_lens, request.end - request.start, m, self.indexer.topk)[0]
            if entries.shape[0]:
                chosen = entries[picks.clamp(min=0).long()]
            else:
                chosen = entries.new_zeros((*picks.shape, entries.shape[-1]))
            bias = torch.zeros(picks.shape, dtype=torch.float32, device=hidden.device)
            bias.masked_fill_(picks < 0, float("-inf"))
            results[request.index] = (chosen, bias.unsqueeze(0))
        return results
