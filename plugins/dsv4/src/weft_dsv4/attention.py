"""DeepSeek V4 attention: shared-KV MQA over a sliding window ring plus, on CSA and HCA layers,
compressed entries (CSA: the indexer's top-k; HCA: every visible one), with a per-head sink in the
softmax and a grouped low-rank output projection."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from weft.api import ColumnParallelLinear, Linear, RowParallelLinear, Shard, copy_checked
from weft.contracts.loader import WeightSlice, as_slice
from weft_dsv4.compressor import Compressor
from weft_dsv4.config import CSA, SLIDING, DeepseekV4Settings, layer_groups
from weft_dsv4.indexer import Indexer
from weft_dsv4.norm import RMSNorm, unweighted_rms_norm
from weft_dsv4.rope import InterleavedRope, apply_rope
from weft_dsv4.step import PrefillBatch, StepLayout


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
        self.q_b_proj = ColumnParallelLinear(
            s.q_lora_rank, [Shard(heads.start * s.head_dim, heads.length * s.head_dim)], bias=False
        )
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
            self.compressor = Compressor(
                s.hidden_size, s.head_dim, s.ratio(self.kind), self.kind == CSA, s.rms_norm_eps, s.lookahead
            )
        if self.kind == CSA:
            self.indexer = Indexer(s)
        self.cache_names = {group: f"model.layers.{index}.self_attn.{group}" for group in layer_groups(self.kind)}
        self.topk_op: Any = None
        """The ``decode_topk`` op implementation, set by the family at build time."""
        self.decode_kernel: Any = None
        """The Triton decode attention (:class:`weft_dsv4.attention_kernel.DecodeAttentionKernel`) where the family
        chose it; None: :meth:`_attend` over gathered keys."""
        self.prefill_kernel: Any = None
        """The Triton prefill attention (:class:`weft_dsv4.attention_kernel.PrefillAttentionKernel`) where the family
        chose it; None: :meth:`_attend` over the padded batch."""

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, ropes: dict[str, InterleavedRope], step: StepLayout
    ) -> torch.Tensor:
        s = self.settings
        tokens, dtype = hidden.shape[0], hidden.dtype
        cos, sin = ropes[self.rope_name].table(positions, dtype)
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        query = self.q_b_proj(q_residual).view(tokens, self.num_heads, self.head_dim)
        query = apply_rope(unweighted_rms_norm(query, s.rms_norm_eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.kv_proj(hidden)), cos, sin)
        output = torch.empty_like(query)
        if step.decode is not None:
            self._decode(query, kv, hidden, q_residual, ropes["compress"], step, output)
        if step.prefills:
            entries, picks = self._compress(hidden, q_residual, positions, ropes["compress"], step)
            batch = step.prefill_batch(self.window)
            keys = self._prefill_window_keys(step, batch, kv)
            if self.prefill_kernel is not None:
                self.prefill_kernel(
                    query=query,
                    output=output,
                    sinks=self.sinks,
                    queries=batch.query_indices,
                    query_rows=batch.query_rows,
                    firsts=batch.firsts,
                    ends=batch.ends,
                    keys=keys,
                    window=self.window,
                    scale=self.head_dim**-0.5,
                    entries=entries,
                    ratio=self.compressor.ratio if self.compressor is not None else 1,
                    picks=picks,
                )
            else:
                entry_bias = None
                if entries is not None:
                    entries, entry_bias = self._padded_entries(batch, entries, picks)
                attended = self._attend(query[batch.query_rows], keys, batch.window_bias, entries, entry_bias)
                output[batch.query_rows[batch.query_valid]] = attended[batch.query_valid]
        output = apply_rope(output, cos, -sin)
        grouped = output.reshape(tokens, s.local_groups, -1)
        weight = self.o_a_proj.weight.view(s.local_groups, s.o_lora_rank, -1)
        mixed = torch.einsum("tgi,gri->tgr", grouped, weight).reshape(tokens, -1)
        return self.o_b_proj(mixed)

    def load_checkpoint_tensor(
        self, parameter: str, weight: WeightSlice | torch.Tensor, name: str, index: int = 0
    ) -> None:
        """The sinks of this rank's heads."""
        copy_checked(
            getattr(self, parameter).data, as_slice(weight).narrow(0, self.heads.start, self.heads.length), name
        )

    def restore(self, step: StepLayout, hit: int, tables: dict[str, torch.Tensor]) -> None:
        """Resume a request from a prefix hit of ``hit`` tokens: its window ring and compressor state
        become the snapshots taken after token ``hit - 1``."""
        block = hit // step.checkpoint_unit - 1
        ring = step.caches[self.cache_names["window"]]
        size = ring.shape[1]
        snapshot = step.caches[self.cache_names["window_checkpoint"]][int(tables["window_checkpoint"][block])].view(
            self.window, -1
        )
        positions = torch.arange(max(hit - self.window, 0), hit, device=ring.device)
        slots = tables["window"][(positions // size) % step.ring_blocks] * size + positions % size
        ring.view(-1, ring.shape[-1])[slots] = snapshot[positions - (hit - self.window)]
        if self.compressor is not None:
            saved = step.caches[self.cache_names["state_checkpoint"]][int(tables["state_checkpoint"][block])]
            step.caches[self.cache_names["compressor_state"]][int(tables["compressor_state"][0])] = saved

    def _prefill_window_keys(self, step: StepLayout, batch: PrefillBatch, kv: torch.Tensor) -> torch.Tensor:
        """Every prefilling request's window keys ``[requests, keys, d]`` (earlier ones from the ring); stores
        the step's own in the ring and snapshots the window at each boundary crossed."""
        ring = step.caches[self.cache_names["window"]]
        flat = ring.view(-1, ring.shape[-1])
        keys = torch.where(batch.from_ring[..., None], flat[batch.ring_slots], kv[batch.new_rows])
        flat[batch.write_slots] = kv[batch.write_rows]
        if batch.snapshot_block is not None:
            snapshots = step.caches[self.cache_names["window_checkpoint"]].view(-1, self.window, ring.shape[-1])
            snapshots[batch.snapshot_block, batch.snapshot_offset] = keys[batch.snapshot_request, batch.snapshot_key]
        return keys

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        bias: torch.Tensor,
        entries: torch.Tensor | None = None,
        entry_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax over each request's keys (also the values) and compressed entries, with the per-head sink.

        ``query`` ``[requests, rows, heads, d]``, ``keys`` ``[requests, keys, d]`` with ``bias`` ``[requests, rows,
        keys]``; ``entries`` are each request's ``[requests, entries, d]`` or each query's ``[requests, rows, k, d]``
        with ``entry_bias`` ``[requests, rows, entries or k]``.
        """
        scale = self.head_dim**-0.5
        logits = (torch.einsum("rthd,rkd->rhtk", query, keys) * scale).float() + bias[:, None]
        if entries is not None:
            pattern = "rthd,rtkd->rhtk" if entries.dim() == 4 else "rthd,rkd->rhtk"
            entry_logits = (torch.einsum(pattern, query, entries) * scale).float() + entry_bias[:, None]
            logits = torch.cat([logits, entry_logits], dim=-1)
        sinks = self.sinks.view(1, -1, 1, 1).expand(logits.shape[0], -1, logits.shape[2], 1)
        combined = torch.cat([logits, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1].to(query.dtype)
        output = torch.einsum("rhtk,rkd->rthd", probs[..., : keys.shape[1]], keys)
        if entries is not None:
            pattern = "rhtk,rtkd->rthd" if entries.dim() == 4 else "rhtk,rkd->rthd"
            output = output + torch.einsum(pattern, probs[..., keys.shape[1] :], entries)
        return output

    def _decode(
        self,
        query: torch.Tensor,
        kv: torch.Tensor,
        hidden: torch.Tensor,
        q_residual: torch.Tensor,
        rope: InterleavedRope,
        step: StepLayout,
        output: torch.Tensor,
    ) -> None:
        """Every one-token request of the step at once: window keys, new entries, indexer picks, attention,
        written to ``output``'s decoding rows. Keys and entries are named by their slots in the flat caches
        (-1: masked), which the kernel reads in place and the torch path gathers."""
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
        window_slots = ring_slots(window.clamp(min=0))
        chosen = batch.completing(step.checkpoint_unit) if step.checkpoint_unit else None  # rows at a snapshot boundary
        if chosen is not None:
            # The window keys of positions p - window + 1 .. p are this boundary's snapshot.
            blocks = self._snapshot_blocks(step, chosen, "window_checkpoint")
            step.caches[self.cache_names["window_checkpoint"]][blocks] = flat[window_slots[chosen]].flatten(1)
        window_slots = torch.where(window >= 0, window_slots, -1)
        entries = entry_slots = None
        if self.compressor is not None:
            m = self.compressor.ratio
            entry_group = "csa_kv" if self.kind == CSA else "hca_kv"
            state = step.caches[self.cache_names["compressor_state"]]
            main = self.compressor.state_elements()
            entry_cache = step.caches[self.cache_names[entry_group]]
            entries = entry_cache.view(-1, entry_cache.shape[-1])
            slots, visible = self.compressor.decode_step(
                hidden[rows],
                batch,
                state[:, :main],
                entry_cache,
                batch.tables[entry_group],
                rope,
            )
            if self.indexer is None:
                entry_slots = torch.where(visible, slots, -1)
            else:
                index_state = state[:, main : main + self.indexer.compressor.state_elements()]
                index_cache = step.caches[self.cache_names["indexer_keys"]]
                index_slots, _ = self.indexer.compressor.decode_step(
                    hidden[rows],
                    batch,
                    index_state,
                    index_cache,
                    batch.tables["indexer_keys"],
                    rope,
                )
                index_keys = self.indexer.compressor.format.decode(
                    index_cache.view(-1, index_cache.shape[-1])[index_slots]
                )
                cos, sin = rope.table(positions, hidden.dtype)
                index_query = self.indexer.q_b_proj(q_residual[rows]).view(
                    -1, self.indexer.num_heads, self.indexer.head_dim
                )
                index_query = apply_rope(index_query, cos, sin)
                index_weights = self.indexer.weights_proj(hidden[rows]).float() * self.indexer.num_heads**-0.5
                scores = self.indexer.scores(index_query.unsqueeze(1), index_weights.unsqueeze(1), index_keys)[:, 0]
                # Row t sees entries w < (t + 1) // m: the op's "blocks of m positions up to pos" shifted by m - 1.
                seq_lens = (positions + 1 - (m - 1)).to(torch.int32)
                picks = self.topk_op(scores.unsqueeze(0), seq_lens, 1, m, self.indexer.topk)[0].long()
                picked_slots = slots.gather(1, picks.clamp(min=0)) if slots.shape[1] else picks
                entry_slots = torch.where(picks >= 0, picked_slots, -1)
                if step.sparse_entries is not None:  # a KV connector holds entries of lent blocks (weft-hisparse)
                    layer_name, picked = self.cache_names[entry_group], gathered(entries, entry_slots)
                    if batch.position_list is None:  # a decode graph: the reader's static rows are the graph's rows
                        picked = step.sparse_entries.read_rows(layer_name, picks, picked)
                    else:
                        request_ids = [step.request_ids[index] for index in batch.indices]
                        picked = step.sparse_entries.read(layer_name, request_ids, picks, picked)
                    entries = picked.reshape(-1, picked.shape[-1])
                    entry_slots = torch.where(
                        picks >= 0, torch.arange(picks.numel(), device=picks.device).view_as(picks), -1
                    )
            if chosen is not None:
                blocks = self._snapshot_blocks(step, chosen, "state_checkpoint")
                step.caches[self.cache_names["state_checkpoint"]][blocks] = state[batch.state_blocks[chosen]]
        if self.decode_kernel is not None:
            self.decode_kernel(
                query=query,
                rows=rows,
                sinks=self.sinks,
                ring=flat,
                window_slots=window_slots,
                output=output,
                scale=self.head_dim**-0.5,
                entries=entries,
                entry_slots=entry_slots,
            )
            return
        keys, bias = gathered(flat, window_slots), slot_bias(window_slots)
        if entries is not None:
            keys = torch.cat([keys, gathered(entries, entry_slots)], dim=1)
            bias = torch.cat([bias, slot_bias(entry_slots)], dim=1)
        output[rows] = self._attend(query[rows].unsqueeze(1), keys, bias.unsqueeze(1))[:, 0]

    def _snapshot_blocks(self, step: StepLayout, chosen: torch.Tensor, group: str) -> torch.Tensor:
        """The snapshot blocks of decoding rows ``chosen``, each at the boundary its token completes; in a decode
        graph (every row chosen) a row whose token completes none writes to the group's scratch block."""
        batch, unit = step.decode, step.checkpoint_unit
        index = ((batch.positions[chosen] + 1) // unit - 1).clamp(min=0)
        blocks = batch.tables[group][chosen].gather(1, index[:, None])[:, 0]
        return batch.or_scratch(chosen, unit, blocks, step.caches[self.cache_names[group]].shape[0] - 1)

    def _compress(
        self,
        hidden: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        rope: InterleavedRope,
        step: StepLayout,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The prefilling requests' compressed entries ``[requests, entries, d]`` (padded past each request's count)
        and, on a CSA layer, the indexer's picks of each query ``[requests, rows, k]`` (-1: none); ``(None, None)``
        on a sliding layer."""
        if self.compressor is None:
            return None, None
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
        batch = step.prefill_batch(self.window)
        main = self.compressor.state_elements()
        snapshots = step.caches.get(self.cache_names.get("state_checkpoint", ""))
        entries = self.compressor.prefill(
            kv,
            gate,
            batch,
            state[:, :main],
            entry_cache,
            step.batches[entry_table].block_table[batch.index].long(),
            rope,
            snapshots[:, :main] if snapshots is not None else None,
        )
        if self.indexer is None:
            return entries, None
        elements = self.indexer.compressor.state_elements()
        index_keys = self.indexer.compressor.prefill(
            index_kv,
            index_gate,
            batch,
            state[:, main : main + elements],
            index_keys_cache,
            step.batches["indexer_keys"].block_table[batch.index].long(),
            rope,
            snapshots[:, main : main + elements] if snapshots is not None else None,
        )
        scores = self.indexer.scores(index_query[batch.query_rows], index_weights[batch.query_rows], index_keys)
        # Row t sees entries w < (t + 1) // m: the op's "blocks of m positions up to pos" shifted by m - 1; the
        # batch's queries are padded in front, so each request's last row sits at its last position.
        requests, rows = batch.query_rows.shape
        seq_lens = (batch.query_positions[:, -1] + 1 - (m - 1)).to(torch.int32)
        picks = (
            self.topk_op(scores.view(1, requests * rows, -1), seq_lens, rows, m, self.indexer.topk)[0]
            .view(requests, rows, -1)
            .long()
        )
        return entries, picks

    def _padded_entries(
        self,
        batch: PrefillBatch,
        entries: torch.Tensor,
        picks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed entries as :meth:`_attend` reads them, with their bias: HCA every entry of each request
        ``[requests, entries, d]``, hidden from a query before it is complete; CSA each query's picks
        ``[requests, rows, k, d]``."""
        if picks is None:
            complete = (batch.query_positions + 1) // self.compressor.ratio
            hidden_entries = (
                torch.arange(entries.shape[1], device=entries.device)[None, None, :] >= complete[:, :, None]
            )
            bias = torch.zeros(hidden_entries.shape, dtype=torch.float32, device=entries.device)
            return entries, bias.masked_fill_(hidden_entries, float("-inf"))
        if entries.shape[1]:
            chosen = entries[torch.arange(picks.shape[0], device=entries.device)[:, None, None], picks.clamp(min=0)]
        else:
            chosen = entries.new_zeros((*picks.shape, entries.shape[-1]))
        return chosen, slot_bias(picks)


def gathered(source: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The vectors of ``source`` ``[slots, d]`` at ``slots`` (any shape), zero where a slot is -1: a masked
    key gets no weight, and zero keeps a non-finite value in another request's slot out of the sum."""
    return torch.where((slots >= 0)[..., None], source[slots.clamp(min=0)], 0.0)


def slot_bias(slots: torch.Tensor) -> torch.Tensor:
    """The softmax bias of keys at ``slots``: 0, or -inf where a slot is -1."""
    return torch.zeros(slots.shape, dtype=torch.float32, device=slots.device).masked_fill_(slots < 0, float("-inf"))


def decode_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Any:
    """The Triton kernel of decode attention, registered for warm-up, on a device Triton compiles for;
    None (:meth:`DeepseekV4Attention._attend`) elsewhere, the CPU included."""
    return _registered_kernel("DecodeAttentionKernel", device, dtype, head_dim)


def prefill_attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Any:
    """The Triton kernel of prefill attention, registered for warm-up, on a device Triton compiles for;
    None (:meth:`DeepseekV4Attention._attend`) elsewhere, the CPU included."""
    return _registered_kernel("PrefillAttentionKernel", device, dtype, head_dim)


def _registered_kernel(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> Any:
    """Kernel class ``name`` of :mod:`weft_dsv4.attention_kernel` for ``dtype`` and ``head_dim``, registered."""
    if device.type not in ("cuda", "xpu") or importlib.util.find_spec("triton") is None:
        return None
    from weft.api import register
    from weft_dsv4 import attention_kernel

    kernel = getattr(attention_kernel, name)()
    kernel.add(dtype, head_dim)
    return register(kernel)
