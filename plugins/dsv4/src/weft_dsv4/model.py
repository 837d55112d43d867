"""DeepSeek V4 (``DeepseekV4ForCausalLM``): one file, top to bottom, following Hugging Face's
``modeling_deepseek_v4.py`` and DeepSeek's causal inference semantics.

Every layer attends over a sliding window of its own keys (shared-KV MQA, one head used as
key and value) plus, on CSA and HCA layers, compressed entries: one per ``m`` source tokens,
pooled by a compressor. CSA layers attend only the entries the lightning indexer picks
(``decode_topk``); HCA layers attend every visible entry. A per-head sink joins the softmax.
The residual is ``hc_mult`` streams mixed by mHC around every sub-block.

The engine's paged attention backend is not used: this module keeps its own per-request
state in five KV-cache groups (see :class:`DeepseekV4Family.kv_cache_groups`):

``window``            the last keys of each layer, a ring of blocks (not prefix-cacheable)
``csa_kv``            CSA compressed entries, one per 4 tokens (prefix-cacheable)
``hca_kv``            HCA compressed entries, one per ``m'`` tokens (prefix-cacheable)
``indexer_keys``      the indexer's compressed keys on CSA layers (prefix-cacheable)
``compressor_state``  the projected ``(kv, gate)`` of the last ``2m`` (CSA) or ``m'`` (HCA) tokens,
                      fp32, a ring indexed by position: the incomplete window and the CSA overlap
                      half-window carried between steps (recurrent; not prefix-cacheable)

Each step works request by request: read what earlier steps left in the caches, add this
step's tokens, write back what later steps need.

Several ranks (``tensor_parallel_size``): each rank holds its attention heads (with their
output groups and sinks), its share of the shared expert's columns and of the vocabulary;
the shared key/value head, the compressors, the indexer, mHC and the router are computed
alike on every rank (their KV-cache groups are the same on every rank). Routed experts are
either split the same way (each expert's columns) or, with ``enable_expert_parallel``,
spread whole over the ranks; either way every rank holds every token (the activations are
replicated), adds what its experts and its shared-expert columns give, and one all-reduce
per layer sums the ranks' shares.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft.contracts.kv_cache import (
    CompressedSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from weft.builtins.decode_topk import DecodeTopKTorch
from weft.contracts.loader import WeightSlice, as_slice
from weft.contracts.model import ModelConfig, ModelFamily
from weft.contracts.parallel import ParallelLayout, check_heads
from weft.distributed.state import current_parallel
from weft.layers.attention import ForwardContext
from weft.layers.linear import Linear, default_dtype
from weft.layers.ops import current_op
from weft.layers.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    copy_checked,
)

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
GROUPS = ("window", "csa_kv", "hca_kv", "indexer_keys", "compressor_state")


class DeepseekV4Settings:
    """The numbers of a DeepSeek V4 ``config.json`` (HF's field names and defaults), validated."""

    def __init__(self, config: dict[str, Any], layout: ParallelLayout | None = None) -> None:
        self.vocab_size = config.get("vocab_size", 129280)
        self.hidden_size = config.get("hidden_size", 4096)
        self.num_layers = config.get("num_hidden_layers", 43)
        self.num_heads = config.get("num_attention_heads", 64)
        self.head_dim = config.get("head_dim", 512)
        self.q_lora_rank = config.get("q_lora_rank", 1024)
        self.moe_intermediate_size = config.get("moe_intermediate_size", 2048)
        self.num_experts = config.get("n_routed_experts", 256)
        self.experts_per_token = config.get("num_experts_per_tok", 6)
        self.scoring_func = config.get("scoring_func", "sqrtsoftplus")
        self.routed_scaling_factor = config.get("routed_scaling_factor", 1.5)
        self.swiglu_limit = config.get("swiglu_limit", 10.0)
        self.sliding_window = config.get("sliding_window", 128)
        self.o_groups = config.get("o_groups", 8)
        self.o_lora_rank = config.get("o_lora_rank", 1024)
        self.index_heads = config.get("index_n_heads", 64)
        self.index_head_dim = config.get("index_head_dim", 128)
        self.index_topk = config.get("index_topk", 512)
        self.hc_mult = config.get("hc_mult", 4)
        self.hc_sinkhorn_iters = config.get("hc_sinkhorn_iters", 20)
        self.hc_eps = config.get("hc_eps", 1e-6)
        self.rms_norm_eps = config.get("rms_norm_eps", 1e-6)
        self.max_position_embeddings = config.get("max_position_embeddings", 1048576)
        num_kv_heads = config.get("num_key_value_heads", 1)
        if num_kv_heads != 1:
            raise ValueError(f"DeepSeek V4: num_key_value_heads is {num_kv_heads}; the architecture has one shared KV head")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"DeepSeek V4: scoring_func {self.scoring_func!r}; expected sqrtsoftplus, sigmoid or softmax")
        rates = dict(config.get("compress_rates") or {CSA: 4, HCA: 128})
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if config.get(legacy) is not None:
                rates[kind] = config[legacy]
        self.compress_rates = rates
        self.layer_types = self._layer_types(config)
        self.mlp_layer_types = self._mlp_layer_types(config)
        self.rope_dim, self.rope = self._rope(config)
        self.layout = layout or ParallelLayout()
        tp, rank = self.layout.tensor_parallel_size, self.layout.tensor_rank
        self.local_heads, self.local_groups = self.num_heads // tp, self.o_groups // tp
        self.shared_intermediate = self.moe_intermediate_size // tp
        """The shared expert's columns on this rank."""
        if self.layout.enable_expert_parallel:
            self.local_experts, self.first_expert = self.num_experts // tp, rank * (self.num_experts // tp)
            self.expert_intermediate = self.moe_intermediate_size
        else:
            self.local_experts, self.first_expert = self.num_experts, 0
            self.expert_intermediate = self.moe_intermediate_size // tp
        """The routed experts this rank holds (``first_expert ..``) and each one's columns here."""

    def check(self) -> None:
        """Raise ValueError, with the numbers and the fix, for a layout this checkpoint cannot take."""
        layout = self.layout
        tp = layout.tensor_parallel_size
        if layout.pipeline_parallel_size > 1:
            raise ValueError(
                f"engine.pipeline_parallel_size = {layout.pipeline_parallel_size}: DeepSeek V4 runs on one pipeline "
                f"stage; use tensor_parallel_size (with enable_expert_parallel) to spread it"
            )
        check_heads("attention heads", self.num_heads, tp)
        divided = [("o_groups (output head groups)", self.o_groups),
                   ("moe_intermediate_size (shared expert columns)", self.moe_intermediate_size)]
        if layout.enable_expert_parallel:
            divided.append(("n_routed_experts", self.num_experts))
        for name, value in divided:
            if value % tp:
                raise ValueError(
                    f"engine.tensor_parallel_size = {tp} does not divide the model's {name} {value}; use a "
                    f"tensor_parallel_size that divides {self.num_heads} heads, {self.o_groups} output groups, "
                    f"moe_intermediate_size {self.moe_intermediate_size}"
                    + (f" and {self.num_experts} routed experts" if layout.enable_expert_parallel else "")
                )

    def _layer_types(self, config: dict[str, Any]) -> list[str]:
        kinds = config.get("layer_types")
        if kinds is None and config.get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
            kinds = [by_ratio[ratio] for ratio in config["compress_ratios"]]
        if kinds is None:
            n = self.num_layers
            kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        kinds = list(kinds[: self.num_layers])
        bad = [kind for kind in kinds if kind not in LAYER_TYPES]
        if len(kinds) != self.num_layers or bad:
            raise ValueError(
                f"DeepSeek V4: layer_types must list {self.num_layers} entries from {LAYER_TYPES}; got {kinds}"
            )
        return kinds

    def _mlp_layer_types(self, config: dict[str, Any]) -> list[str]:
        kinds = config.get("mlp_layer_types")
        if kinds is None:
            hashed = config.get("num_hash_layers", 3)
            kinds = ["hash_moe"] * min(self.num_layers, hashed) + ["moe"] * max(0, self.num_layers - hashed)
        kinds = list(kinds[: self.num_layers])
        if len(kinds) != self.num_layers or any(kind not in ("hash_moe", "moe") for kind in kinds):
            raise ValueError(f"DeepSeek V4: mlp_layer_types must list {self.num_layers} of 'hash_moe'/'moe'; got {kinds}")
        return kinds

    def _rope(self, config: dict[str, Any]) -> tuple[int, dict[str, dict[str, Any]]]:
        factor = config.get("partial_rotary_factor")
        if factor is None:
            rope_head_dim = config.get("qk_rope_head_dim")
            factor = rope_head_dim / self.head_dim if rope_head_dim is not None else 64 / 512
        parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(parameters.get("main"), dict) and isinstance(parameters.get("compress"), dict):
            rope = {"main": dict(parameters["main"]), "compress": dict(parameters["compress"])}
        else:
            scaling = {key: value for key, value in parameters.items() if key not in ("main", "compress")}
            rope = {
                "main": {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)},
                "compress": {**scaling, "rope_theta": config.get("compress_rope_theta", 160000.0)},
            }
            rope["compress"].setdefault("rope_type", rope["compress"].pop("type", "default"))
            if rope["compress"]["rope_type"] == "yarn":
                rope["compress"].setdefault("attention_factor", 1.0)
        for name, entry in rope.items():
            entry.setdefault("partial_rotary_factor", factor)
            entry.setdefault("rope_type", "default")
            if entry["rope_type"] not in ("default", "yarn"):
                raise ValueError(f"DeepSeek V4: rope_parameters.{name}.rope_type {entry['rope_type']!r}; expected default or yarn")
        return int(self.head_dim * factor), rope

    def ratio(self, kind: str) -> int:
        return self.compress_rates[kind]

    def state_elements(self, kind: str) -> int:
        """fp32 elements of one layer's compressor state: projected kv and gate of a ring of positions."""
        if kind == CSA:
            return 2 * self.ratio(CSA) * 2 * (2 * self.head_dim + 2 * self.index_head_dim)
        if kind == HCA:
            return self.ratio(HCA) * 2 * self.head_dim
        return 0


def rope_inverse_frequencies(parameters: dict[str, Any], head_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (one per interleaved pair) and the cos/sin scale of one rope type."""
    dim = int(head_dim * parameters["partial_rotary_factor"])
    base = float(parameters["rope_theta"])
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    inv_freq = 1.0 / (base**exponents)
    if parameters["rope_type"] == "default":
        return inv_freq, 1.0
    # YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between.
    factor = parameters["factor"]
    original = parameters["original_max_position_embeddings"]
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    scale = parameters.get("attention_factor")
    if scale is None:
        scale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(scale)


class InterleavedRope(nn.Module):
    """cos/sin tables of one rope type; rotates the trailing ``rope_dim`` channels in (even, odd) pairs."""

    def __init__(self, parameters: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(parameters, head_dim, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # HF casts the tables to the activation dtype before rotating in fp32; so do we.
        cos = self.cos[positions].to(dtype).float().repeat_interleave(2, dim=-1)
        sin = self.sin[positions].to(dtype).float().repeat_interleave(2, dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``cos.shape[-1]`` channels of ``x`` ``[T, ..., D]``; cos/sin are ``[T, rope_dim]``."""
    rope_dim = cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rope_dim:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], (rope * cos + rotated * sin).to(x.dtype)], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, multiplied in fp32 and cast once (as DeepSeek V4 keeps its norms)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """Pools ``ratio`` tokens into one entry: per-channel softmax of ``gate + position_bias`` over the
    window's tokens weighting ``kv``, then RMSNorm and RoPE at the window's first position.

    With ``overlap`` (CSA) projections are ``2 * dim`` wide: entry ``w`` pools the first half of the
    tokens of window ``w - 1`` together with the second half of the tokens of window ``w``.
    """

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.ratio, self.overlap, self.width = dim, ratio, overlap, width
        self.kv_proj = Linear(hidden_size, width, bias=False)
        self.gate_proj = Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)

    @property
    def span(self) -> int:
        """Positions of source tokens kept in the state ring."""
        return 2 * self.ratio if self.overlap else self.ratio

    def state_elements(self) -> int:
        return self.span * 2 * self.width

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv`` (activation dtype) and ``gate + position_bias`` (fp32) of each token."""
        return self.kv_proj(hidden), self.gate_proj(hidden) + self.position_bias[positions % self.ratio]

    def step(
        self, kv: torch.Tensor, gate: torch.Tensor, start: int, state: torch.Tensor, rope: InterleavedRope
    ) -> tuple[int, torch.Tensor]:
        """Add tokens ``start .. start + n - 1`` (their projections) to one request's windows.

        ``state`` is the request's fp32 ring ``[span, 2 * width]`` (kv | gate per position, slot
        ``position % span``), updated in place. Returns the index of the first entry completed
        and the completed entries ``[count, dim]`` (possibly none).
        """
        m, n, end = self.ratio, kv.shape[0], start + kv.shape[0]
        first, last = start // m, end // m
        entries = kv.new_zeros((0, self.dim))
        if last > first:
            base = max(first - 1, 0) * m if self.overlap else first * m
            old = torch.arange(base, start, device=kv.device)
            source_kv = torch.cat([state[old % self.span, : self.width].to(kv.dtype), kv[: last * m - start]])
            source_gate = torch.cat([state[old % self.span, self.width :], gate[: last * m - start]])
            entries = self._pool(source_kv, source_gate, first, last)
            positions = torch.arange(first, last, device=kv.device) * m
            entries = apply_rope(entries, *rope.table(positions, entries.dtype))
        keep = min(n, self.span)
        slots = torch.arange(end - keep, end, device=kv.device) % self.span
        state[slots] = torch.cat([kv[n - keep :].float(), gate[n - keep :]], dim=-1)
        return first, entries

    def decode_step(
        self, hidden: torch.Tensor, batch: DecodeBatch, state: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
        rope: InterleavedRope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token for each decoding request: record it in the state ring, pool and store the
        entries of the windows it completes, and return every request's entries ``[rows, n, dim]``
        (padded to the longest) with their validity ``[rows, n]``.

        ``state`` is the layer's state columns of this compressor, ``[blocks, span * 2 * width]``.
        """
        m, span, width = self.ratio, self.span, self.width
        positions = batch.positions
        kv, gate = self.project(hidden, positions)
        ring = state.view(state.shape[0], span, 2 * width)
        ring[batch.state_blocks, positions % span] = torch.cat([kv.float(), gate], dim=-1)
        per_block = cache.shape[1]
        flat = cache.view(-1, cache.shape[-1])
        complete = [row for row, position in enumerate(batch.position_list) if (position + 1) % m == 0]
        if complete:
            rows = torch.tensor(complete, device=kv.device)
            window = (positions[rows] + 1) // m - 1
            width_tokens = 2 * m if self.overlap else m
            source = (window[:, None] - (1 if self.overlap else 0)) * m + torch.arange(width_tokens, device=kv.device)
            gathered = ring[batch.state_blocks[rows][:, None], source % span]
            source_kv, source_gate = gathered[..., :width].to(kv.dtype), gathered[..., width:]
            if self.overlap:
                d = self.dim
                source_kv = torch.cat([source_kv[:, :m, :d], source_kv[:, m:, d:]], dim=1)
                source_gate = torch.cat([source_gate[:, :m, :d], source_gate[:, m:, d:]], dim=1)
                # Entry 0 has no window before it: its a-half is kv 0 with weight 0.
                missing = (window == 0)[:, None, None] & (torch.arange(2 * m, device=kv.device) < m)[None, :, None]
                source_kv = source_kv.masked_fill(missing, 0.0)
                source_gate = source_gate.masked_fill(missing, float("-inf"))
            entries = self.pool_windows(source_kv, source_gate)
            entries = apply_rope(entries, *rope.table(window * m, entries.dtype))
            slots = table[rows].gather(1, (window // per_block)[:, None])[:, 0] * per_block + window % per_block
            flat[slots] = entries.to(cache.dtype)
        counts = (positions + 1) // m
        longest = max((position + 1) // m for position in batch.position_list)
        index = torch.arange(longest, device=kv.device).expand(len(batch.position_list), -1)
        entries = flat[table.gather(1, index // per_block) * per_block + index % per_block]
        return entries, index < counts[:, None]

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Entries ``first .. last - 1`` from the consecutive source tokens of their windows."""
        m, d, count = self.ratio, self.dim, last - first
        if not self.overlap:
            kv, gate = kv.view(count, m, d), gate.view(count, m, d)
        else:
            # [count, 2m, d]: half a of the window before, half b of the window itself.
            if first == 0:
                kv = torch.cat([kv.new_zeros((m, 2 * d)), kv])
                gate = torch.cat([gate.new_full((m, 2 * d), float("-inf")), gate])
            windows_kv = kv.view(count + 1, m, 2 * d)
            windows_gate = gate.view(count + 1, m, 2 * d)
            kv = torch.cat([windows_kv[:-1, :, :d], windows_kv[1:, :, d:]], dim=1)
            gate = torch.cat([windows_gate[:-1, :, :d], windows_gate[1:, :, d:]], dim=1)
        return self.pool_windows(kv, gate)

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``[count, slots, dim]`` windows to entries: softmax over the slots per channel (fp32), weighted sum, norm."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=1))


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer: its own compressor at ``index_head_dim``, and the
    score ``I[t, w] = sum_h w_{t,h} * ReLU(q_{t,h} . K_w) / sqrt(d)`` of every visible entry."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = s.index_heads, s.index_head_dim, s.index_topk
        self.compressor = Compressor(s.hidden_size, s.index_head_dim, s.ratio(CSA), True, s.rms_norm_eps)
        self.q_b_proj = Linear(s.q_lora_rank, s.index_heads * s.index_head_dim, bias=False)
        self.weights_proj = Linear(s.hidden_size, s.index_heads, bias=False)

    def scores(self, query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[rows, entries]`` from indexer queries ``[rows, heads, d]``, head weights ``[rows, heads]``, keys."""
        dots = torch.einsum("thd,wd->thw", query.float(), keys.float())
        return (F.relu(dots) * self.head_dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)

    def row_scores(self, query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """As :meth:`scores`, each row with its own keys ``[rows, entries, d]``."""
        dots = torch.einsum("bhd,bwd->bhw", query.float(), keys.float())
        return (F.relu(dots) * self.head_dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)


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
            keys = torch.cat([keys, picked], dim=1)
            bias = torch.cat([bias, picked_bias], dim=1)
        return self._attend_rows(query[rows], keys, bias)

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
            first, new = self.compressor.step(kv[rows], gate[rows], request.start, main_state, rope)
            entries = _write_and_read(entry_cache, request.tables[entry_table], first, new, request.end // m, m)
            query_positions = positions[rows]
            visible = (query_positions + 1) // m
            if self.indexer is None:
                bias = torch.zeros((query_positions.numel(), entries.shape[0]), dtype=torch.float32, device=hidden.device)
                bias.masked_fill_(torch.arange(entries.shape[0], device=hidden.device).view(1, -1) >= visible.view(-1, 1), float("-inf"))
                results[request.index] = (entries, bias)
                continue
            index_state = layer_state[self.compressor.state_elements() :][: self.indexer.compressor.state_elements()]
            index_state = index_state.view(self.indexer.compressor.span, -1)
            first, new_keys = self.indexer.compressor.step(index_kv[rows], index_gate[rows], request.start, index_state, rope)
            keys = _write_and_read(index_keys_cache, request.tables["indexer_keys"], first, new_keys, request.end // m, m)
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


def _write_and_read(cache: torch.Tensor, table: torch.Tensor, first: int, new: torch.Tensor, count: int, ratio: int) -> torch.Tensor:
    """Store entries ``first ..`` of one request into its compressed-group blocks; return entries ``0 .. count - 1``."""
    per_block = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    if new.shape[0]:
        index = torch.arange(first, first + new.shape[0], device=new.device)
        flat[table[index // per_block] * per_block + index % per_block] = new.to(cache.dtype)
    index = torch.arange(count, device=cache.device)
    return flat[table[index // per_block] * per_block + index % per_block]


class HyperConnection(nn.Module):
    """mHC weights of one sub-block: ``pre`` collapses the streams, ``post`` expands the block output,
    ``comb`` (Sinkhorn-normalised, doubly stochastic) mixes the residual streams."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        n = s.hc_mult
        self.hc_mult, self.iterations, self.hc_eps, self.norm_eps = n, s.hc_sinkhorn_iters, s.hc_eps, s.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * s.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pre`` ``[T, n]``, ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` (fp32) of streams ``[T, n, H]``."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        # comb is applied transposed: stream k gets sum_j comb[j, k] * streams[j].
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """Collapses the streams once, before the final norm."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        n = s.hc_mult
        self.hc_eps, self.norm_eps = s.hc_eps, s.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * s.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """This rank's columns of the shared expert; returns its partial sum (the MoE all-reduces once)."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        columns = Shard(s.layout.tensor_rank * s.shared_intermediate, s.shared_intermediate)
        self.gate_proj = ColumnParallelLinear(s.hidden_size, [columns], bias=False)
        self.up_proj = ColumnParallelLinear(s.hidden_size, [columns], bias=False)
        self.down_proj = RowParallelLinear(columns, s.hidden_size, bias=False, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    """Expert weights from the learned gate; the experts themselves from ``tid2eid[token]`` (hash
    layers) or the top-k of ``score + e_score_correction_bias``."""

    def __init__(self, s: DeepseekV4Settings, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k = hashed, s.experts_per_token
        self.scoring_func, self.scaling = s.scoring_func, s.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(s.num_experts, s.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(s.vocab_size, s.experts_per_token, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(s.num_experts, dtype=torch.float32))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)
        if self.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scaling


class Experts(nn.Module):
    """This rank's routed experts as stacked tensors: ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``
    (``E`` the experts it holds, ``I`` each one's columns it holds); returns its partial sum."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        self.limit = s.swiglu_limit
        self.first, self.count = s.first_expert, s.local_experts
        self.columns = Shard(0 if s.layout.enable_expert_parallel else s.layout.tensor_rank * s.expert_intermediate,
                             s.expert_intermediate)
        self.full_intermediate = s.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.count, 2 * s.expert_intermediate, s.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.count, s.hidden_size, s.expert_intermediate))

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        output = torch.zeros_like(hidden)
        for expert in experts.unique().tolist():
            if not self.holds(expert):
                continue  # another rank's: it adds that expert's share
            tokens, slot = torch.where(experts == expert)
            local = expert - self.first
            gate, up = F.linear(hidden[tokens], self.gate_up_proj[local]).chunk(2, dim=-1)
            current = F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[local])
            output.index_add_(0, tokens, (current * weights[tokens, slot, None]).to(output.dtype))
        return output

    def load_expert(self, parameter: str, expert: int, part: str, weight: WeightSlice | torch.Tensor, name: str) -> None:
        """One expert's ``gate``/``up`` (``[I, H]``) or ``down`` (``[H, I]``) tensor: this rank's columns of it."""
        weight, local, columns = as_slice(weight), expert - self.first, self.columns
        if part == "down":
            copy_checked(self.down_proj.data[local], weight.narrow(1, columns.start, columns.length), name)
            return
        offset = 0 if part == "gate" else columns.length
        copy_checked(self.gate_up_proj.data[local].narrow(0, offset, columns.length),
                     weight.narrow(0, columns.start, columns.length), name)

    def load_stacked(self, parameter: str, weight: WeightSlice | torch.Tensor, name: str) -> None:
        """The stacked tensor of every expert (``[E, 2I, H]`` or ``[E, H, I]``): this rank's experts and columns."""
        stacked = as_slice(weight).narrow(0, self.first, self.count)
        columns = self.columns
        if parameter == "down_proj":
            copy_checked(self.down_proj.data, stacked.narrow(2, columns.start, columns.length), name)
            return
        gate = stacked.narrow(1, columns.start, columns.length)
        up = stacked.narrow(1, self.full_intermediate + columns.start, columns.length)
        copy_checked(self.gate_up_proj.data, torch.cat([gate, up], dim=1), name)


class MoE(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.gate = Router(s, s.mlp_layer_types[index] == "hash_moe")
        self.experts = Experts(s)
        self.shared_experts = SharedExpert(s)
        self.tensor = current_parallel().tensor

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        experts, weights = self.gate(hidden, input_ids)
        return self.tensor.all_reduce(self.experts(hidden, experts, weights) + self.shared_experts(hidden))


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(s, index)
        self.mlp = MoE(s, index)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn_hc = HyperConnection(s)
        self.ffn_hc = HyperConnection(s)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, ropes: dict[str, InterleavedRope], step: StepLayout) -> torch.Tensor:
        pre, post, comb = self.attn_hc.weights(streams)
        attention = self.self_attn(self.input_layernorm(HyperConnection.collapse(pre, streams)), positions, ropes, step)
        streams = HyperConnection.expand(post, comb, attention, streams)
        pre, post, comb = self.ffn_hc.weights(streams)
        mlp = self.mlp(self.post_attention_layernorm(HyperConnection.collapse(pre, streams)), input_ids)
        return HyperConnection.expand(post, comb, mlp, streams)


class DeepseekV4Model(nn.Module):
    def __init__(self, s: DeepseekV4Settings, max_positions: int) -> None:
        super().__init__()
        self.hc_mult = s.hc_mult
        self.group_names: tuple[str, ...] = ()
        """The KV-cache groups in the engine's order, and the window ring's length in blocks (set by the family)."""
        self.ring_blocks = 0
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(s, index) for index in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hc_head = HyperHead(s)
        self.ropes = nn.ModuleDict({name: InterleavedRope(s.rope[name], s.head_dim, max_positions) for name in ("main", "compress")})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        step = StepLayout(context, self.group_names, self.ring_blocks)
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        ropes = dict(self.ropes.items())
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, ropes, step)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, s: DeepseekV4Settings, max_positions: int) -> None:
        super().__init__()
        self.settings = s
        self.model = DeepseekV4Model(s, max_positions)
        self.lm_head = ParallelLMHead(s.hidden_size, s.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, context)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def layer_groups(kind: str) -> tuple[str, ...]:
    """The KV-cache groups a layer of this type holds state in."""
    if kind == CSA:
        return ("window", "csa_kv", "indexer_keys", "compressor_state")
    if kind == HCA:
        return ("window", "hca_kv", "compressor_state")
    return ("window",)


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
        self.ring_blocks = ring_blocks
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


# DeepSeek's own tensor names (as in its releases, and as transformers saves V4) -> Hugging Face's module names.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    # Hugging Face's module names -> this file's (the indexer is the attention's child here).
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.q_b_proj."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def parameter_name(checkpoint_name: str) -> tuple[str, int | None, str | None]:
    """This module's parameter for a checkpoint tensor: ``(name, expert, part)``; part is
    ``"gate"``/``"up"``/``"down"`` for one expert's slice of the stacked expert tensors."""
    name = checkpoint_name[len("model.") :] if checkpoint_name.startswith("model.") else checkpoint_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    expert = _EXPERT.match(name)
    if expert:
        prefix, index, part = expert.groups()
        target = "gate_up_proj" if part in ("w1", "w3") else "down_proj"
        name, index_value, part_name = f"{prefix}.{target}", int(index), {"w1": "gate", "w3": "up", "w2": "down"}[part]
    else:
        index_value, part_name = None, None
    return (name if name.startswith("lm_head.") else f"model.{name}"), index_value, part_name


class DeepseekV4Family(ModelFamily):
    """DeepSeek V4 / V4.1 (``DeepseekV4ForCausalLM``): CSA/HCA compressed sparse attention, mHC, hash MoE."""

    reads_weight_slices = True

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        s = DeepseekV4Settings(config.hf_config)
        block_size = config.block_size
        kinds = s.layer_types

        def names(group: str) -> tuple[str, ...]:
            return tuple(f"model.layers.{i}.self_attn.{group}" for i, kind in enumerate(kinds) if group in layer_groups(kind))

        def compressed_block(ratio: int) -> int:
            return math.lcm(block_size, ratio)

        groups = [
            KVCacheGroupSpec("window", names("window"), SlidingWindowSpec(
                block_size=block_size, dtype=config.dtype, num_kv_heads=1, head_dim=s.head_dim,
                window=s.sliding_window, ring=True,
            )),
        ]
        if CSA in kinds:
            ratio = s.ratio(CSA)
            groups.append(KVCacheGroupSpec("csa_kv", names("csa_kv"), CompressedSpec(
                block_size=compressed_block(ratio), dtype=config.dtype, compress_ratio=ratio, entry_dim=s.head_dim,
            )))
        if HCA in kinds:
            ratio = s.ratio(HCA)
            groups.append(KVCacheGroupSpec("hca_kv", names("hca_kv"), CompressedSpec(
                block_size=compressed_block(ratio), dtype=config.dtype, compress_ratio=ratio, entry_dim=s.head_dim,
            )))
        if CSA in kinds:
            ratio = s.ratio(CSA)
            groups.append(KVCacheGroupSpec("indexer_keys", names("indexer_keys"), CompressedSpec(
                block_size=compressed_block(ratio), dtype=config.dtype, compress_ratio=ratio, entry_dim=s.index_head_dim,
            )))
        if CSA in kinds or HCA in kinds:
            elements = max(s.state_elements(kind) for kind in kinds)
            groups.append(KVCacheGroupSpec("compressor_state", names("compressor_state"), RecurrentStateSpec(
                block_size=block_size, dtype="float32", state_elements=elements,
            )))
        return tuple(groups)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        if isinstance(spec, SlidingWindowSpec):  # keys are the values: one tensor per slot
            return (num_blocks, spec.block_size, spec.head_dim)
        if isinstance(spec, CompressedSpec):
            return (num_blocks, spec.block_size // spec.compress_ratio, spec.entry_dim)
        if isinstance(spec, RecurrentStateSpec):
            return (num_blocks, spec.state_elements)
        raise ValueError(f"DeepSeek V4 declares no {type(spec).__name__} group")

    def load_dtype(self, dtype: str) -> str:
        # mHC, sinks, position biases and norm weights stay float32 in a bf16 model: read the
        # checkpoint at full precision; copy_ rounds the rest into their parameters.
        return "float32"

    def hf_reference_context(self) -> contextlib.AbstractContextManager[None]:
        # transformers' indexer calls torch.topk, whose CPU tie order depends on the row length;
        # a stable top-k breaks ties toward the lower index, as Weft's decode_topk does.
        from weft_dsv4.reference import stable_topk

        return stable_topk()

    def check_parallel(self, config: ModelConfig) -> None:
        DeepseekV4Settings(config.hf_config, config.parallel).check()

    def build(self, config: ModelConfig, device: torch.device) -> DeepseekV4ForCausalLM:
        s = DeepseekV4Settings(config.hf_config, config.parallel)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = DeepseekV4ForCausalLM(s, config.max_model_len)
        groups = self.kv_cache_groups(config)
        module.model.group_names = tuple(group.name for group in groups)
        module.model.ring_blocks = groups[0].spec.ring_blocks
        topk = current_op("decode_topk") or DecodeTopKTorch(None)
        for layer in module.model.layers:
            layer.self_attn.topk_op = topk
        module.model.ropes.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        """Whole tensors or :class:`~weft.contracts.loader.WeightSlice` objects: each rank reads its part
        (its heads, columns and vocabulary rows; under expert parallelism only its experts)."""
        targets = dict(module.named_parameters())
        targets.update((name, buffer) for name, buffer in module.named_buffers() if name.endswith(("tid2eid", "e_score_correction_bias")))
        filled: set[str] = set()
        for checkpoint_name, tensor in weights:
            if checkpoint_name.startswith("mtp.") or ".mtp." in checkpoint_name:
                continue  # the multi-token-prediction head is not part of the causal model
            if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(
                    f"checkpoint tensor {checkpoint_name!r} is {tensor.dtype}: quantised DeepSeek V4 checkpoints are not "
                    f"supported yet; dequantise it to bfloat16 first"
                )
            name, expert, part = parameter_name(checkpoint_name)
            if name not in targets:
                raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no parameter in {type(module).__name__}")
            owner_name, _, parameter = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            if isinstance(owner, Experts):
                if expert is None:
                    owner.load_stacked(parameter, tensor, checkpoint_name)
                    filled.add(name)
                elif owner.holds(expert):  # another rank's expert is never read
                    owner.load_expert(parameter, expert, part, tensor, checkpoint_name)
                    filled.add(f"{name}#{expert}.{part}")
                continue
            loader = getattr(owner, "load_checkpoint_tensor", None)
            if loader is not None:
                loader(parameter, tensor, checkpoint_name)
            else:
                copy_checked(targets[name].data, as_slice(tensor).load(), checkpoint_name)
            filled.add(name)
        expected = set()
        for name in targets:
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and name not in filled:
                experts = module.get_submodule(name.rpartition(".")[0])
                parts = ("down",) if name.endswith("down_proj") else ("gate", "up")
                expected |= {f"{name}#{e}.{p}" for e in range(experts.first, experts.first + experts.count) for p in parts}
            else:
                expected.add(name)
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")
