"""DeepSeek V4's multi-token-prediction (MTP, "DSpark") layers as the ``mtp`` speculator.

A V4 checkpoint carries ``num_nextn_predict_layers`` MTP layers beside the causal model (``mtp.N.*``; the
target's own load skips them). As DeepSeek's ``MTPBlock``, layer N at position ``p`` takes the target's residual
streams there (``[hc_mult, hidden]``, before ``hc_head``) and the embedding of the token at ``p + 1``:

    streams = e_proj(enorm(embed(t[p+1]))) (broadcast over the streams) + h_proj(hnorm(h[p]))
    streams = block(streams)                          a decoder block: window attention only, scored MoE
    logits  = lm_head(norm(hc_head(streams)))         its own hc_head and norm, the target's LM head

and predicts the token at ``p + 2``. The embedding and the LM head are the target's modules (shared, never
copied). A chain of ``k`` proposals feeds the block its own output streams and its last proposal: proposal ``m``
comes from the entry at ``p + m - 1``. The chain runs through ``mtp.0`` (DeepSeek V4 ships one MTP layer; a
further layer would need its own window of entries computed from the target's streams).

The block attends over its own window of earlier entries, so the speculator feeds it the positions the target
computes: core hands it the target's streams after each forward (:meth:`MtpSpeculator.take_hidden_states`),
it keeps them until the next token is known, and drops the rows of proposals the target rejected. An entry's
key depends on its own inputs only, and a proposal attends the last ``sliding_window`` entries: older positions
(most of a long prompt) are skipped. To propose, it
feeds each request's entries its cache lacks (``p`` up to the target's newest computed position, whose next
token is the target's newest) in one forward, whose last entry gives the first proposal, then one entry per
further proposal. The entries the chain wrote past the verified ones are written over by the next catch-up.
Proposals are the argmax (deterministic: one-hot draws for the rejection sampler).

A request resumed from a prefix-cache hit has no target streams for the cached positions (the target did not
compute them): its entries start at the first position the target computed, numbered from 0 there (RoPE is
relative, so this is the block attending only the entries it has). Its proposals may then differ from a cold
run's; the output does not.

Parallel layout: the layers are built with :func:`weft_dsv4.parallel.draft_parallel_config` from the target's
``ModelConfig.parallel``: the target's layout whole, its tensor-parallel size (the embedding and LM head are the
target's shards), one pipeline stage, expert parallelism passed through to the MoE block (a dense block would
not inherit it). Its KV cache is one ``window`` ring per layer in the engine's paged cache (group ``mtp.window``),
allocated, rolled back and freed with the target's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import nn

from weft.api import InputBuilder, Linear, default_dtype, greedy_in_vocabulary, known_only
from weft.contracts.kv_cache import KVCacheGroupSpec, SlidingWindowSpec
from weft.contracts.speculator import (
    DraftModelLoader,
    Proposals,
    ProposalStep,
    SpeculationRequest,
    Speculator,
    TargetHiddenStates,
    Verified,
)
from weft_dsv4.config import SLIDING, DeepseekV4Settings
from weft_dsv4.mhc import HyperHead
from weft_dsv4.model import DeepseekV4DecoderLayer, DeepseekV4ForCausalLM, load_parameters
from weft_dsv4.norm import RMSNorm
from weft_dsv4.parallel import draft_parallel_config
from weft_dsv4.step import StepLayout
from weft_dsv4.weights import parameter_name

if TYPE_CHECKING:
    from weft.contracts.parallel import ParallelLayout
    from weft.contracts.speculator import DraftModel

logger = logging.getLogger("weft.dsv4")

GROUP = "mtp.window"
"""The engine's name of the MTP layers' window rings (apart from every name of the target's)."""

OWN_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
}
"""An MTP layer's own tensors (DeepSeek's names after ``mtp.N.``) -> its parameters; the rest are its block's."""
SHARED = ("emb.tok_emb.weight", "embed.weight", "head.weight")
"""Copies of the target's embedding and LM head some exports add under ``mtp.N.``: the target's are used."""
_MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.+)$")


def mtp_settings(hf_config: dict[str, Any], layout: ParallelLayout) -> DeepseekV4Settings:
    """The numbers of an MTP layer's block: the target's, as one window-only layer with a scored MoE."""
    config = dict(hf_config, num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])
    config.pop("compress_ratios", None)
    return DeepseekV4Settings(config, layout)


def mtp_parameter_name(checkpoint_name: str, layer: int) -> tuple[str, int | None, str | None] | None:
    """The parameter of MTP layer ``layer``'s module for a checkpoint tensor (as
    :func:`weft_dsv4.weights.parameter_name`); None for a tensor of another layer, of the causal model, or a copy
    of the target's embedding or LM head."""
    match = _MTP_NAME.match(checkpoint_name)
    if match is None or int(match.group(1)) != layer or match.group(2) in SHARED:
        return None
    rest = match.group(2)
    if rest in OWN_NAMES:
        return OWN_NAMES[rest], None, None
    name, expert, part = parameter_name(f"layers.0.{rest}")
    if not name.startswith("model.layers.0."):
        raise ValueError(f"checkpoint tensor {checkpoint_name!r}: not a tensor of a DeepSeek V4 MTP layer")
    return "block." + name[len("model.layers.0.") :], expert, part


class DeepseekV4MTPLayer(nn.Module):
    """One MTP layer (module docstring); the target's embedding, RoPE tables and LM head are used, not held."""

    def __init__(self, s: DeepseekV4Settings, target: DeepseekV4ForCausalLM, index: int) -> None:
        super().__init__()
        self.hc_mult, self.hidden_size = s.hc_mult, s.hidden_size
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.e_proj = Linear(s.hidden_size, s.hidden_size, bias=False)
        self.h_proj = Linear(s.hidden_size, s.hidden_size, bias=False)
        self.block = DeepseekV4DecoderLayer(s, 0)
        self.block.self_attn.cache_names = {"window": layer_name(index)}
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hc_head = HyperHead(s)
        self.ring_blocks = 0
        """The window ring's length in blocks (set from the group's spec)."""
        self._target = (target,)  # in a tuple: not a submodule (its parameters are the target's)

    def wire(self) -> None:
        """Take the kernels and ops the family chose for the target's layers (every layer has the same ones)."""
        source = self._target[0].model.layers[0]
        attention = self.block.self_attn
        attention.topk_op = source.self_attn.topk_op
        attention.decode_kernel = source.self_attn.decode_kernel
        attention.prefill_kernel = source.self_attn.prefill_kernel
        self.block.attn_hc.kernel = self.block.ffn_hc.kernel = source.attn_hc.kernel

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor, context: Any
    ) -> torch.Tensor:
        """The entries' output streams ``[T, hc_mult, hidden]`` from the tokens ``input_ids`` (each entry's next
        token) and ``previous`` ``[T, hc_mult * hidden]`` (the target's streams, or this layer's own)."""
        target = self._target[0].model
        step = StepLayout(context, ("window",), self.ring_blocks)
        tokens = input_ids.shape[0]
        embedded = self.e_proj(self.enorm(target.embed_tokens(input_ids)))
        hidden = previous.reshape(tokens * self.hc_mult, self.hidden_size).to(embedded.dtype)
        streams = embedded.unsqueeze(1) + self.h_proj(self.hnorm(hidden)).view(tokens, self.hc_mult, -1)
        return self.block(streams, input_ids, positions, dict(target.ropes.items()), step)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(self.norm(self.hc_head(streams)))


def layer_name(index: int) -> str:
    return f"mtp.{index}.self_attn.window"


class MtpOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class _Row:
    """One request's entries in an MTP forward, in the shape :class:`InputBuilder` reads a request state:
    ``token_ids`` are the entries' input tokens (entry ``j`` reads the token after its target position)."""

    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "block_ids")

    def __init__(self, request_id: str, token_ids: list[int], start: int, block_ids: list[list[int]]) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_computed_tokens = start
        self.block_ids = block_ids

    def take_prefix_hit(self) -> int:
        return 0


class _Followed:
    """A request as the MTP layers follow it.

    ``token_ids``: its tokens. ``first``: the target position of entry 0 (None until the target computed any of
    it). ``done``: entries in the MTP cache, computed from verified streams. ``rows`` / ``rows_start``: the
    target's streams of positions ``rows_start ..`` not fed yet (the step's rejected proposals cut off)."""

    __slots__ = ("token_ids", "first", "done", "rows", "rows_start")

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.first: int | None = None
        self.done = 0
        self.rows: list[torch.Tensor] = []
        self.rows_start = 0

    @property
    def rows_end(self) -> int:
        return self.rows_start + sum(rows.shape[0] for rows in self.rows)

    def take_rows_before(self, end: int) -> list[torch.Tensor]:
        """The streams of positions ``rows_start .. end - 1``, no longer kept; later ones stay."""
        taken, kept, position = [], [], self.rows_start
        for rows in self.rows:
            size = rows.shape[0]
            if position + size <= end:
                taken.append(rows)
            elif position >= end:
                kept.append(rows)
            else:
                taken.append(rows[: end - position])
                kept.append(rows[end - position :])
            position += size
        self.rows, self.rows_start = kept, end
        return taken

    def keep_rows_before(self, end: int) -> None:
        """Drop the streams of positions ``end ..`` (rejected proposals, or positions computed again)."""
        kept, position = [], self.rows_start
        for rows in self.rows:
            if position >= end:
                break
            kept.append(rows[: end - position])
            position += rows.shape[0]
        self.rows = kept


class MtpSpeculator(Speculator):
    """Greedy proposals of the checkpoint's MTP layers (module docstring)."""

    name = "mtp"
    owns_model = True
    needs_hidden_states = True
    Options = MtpOptions

    def __init__(self, options: msgspec.Struct | None, config: Any) -> None:
        super().__init__(options, config)
        self.requests: dict[str, _Followed] = {}
        self.layers: list[DeepseekV4MTPLayer] = []
        self.layout: ParallelLayout | None = None
        """The layers' parallel layout (:func:`draft_parallel_config` of the target's)."""
        self._groups: tuple[KVCacheGroupSpec, ...] = ()
        self._inputs: Any = None
        self._device: torch.device | None = None
        self._keep = 0

    def load(self, models: DraftModelLoader) -> None:
        target: DraftModel = models.target
        module = target.model
        if not isinstance(module, DeepseekV4ForCausalLM):
            raise ValueError(
                f"[engine.speculative] method = 'mtp' runs DeepSeek V4's multi-token-prediction layers; the target "
                f"is a {type(module).__name__}: use 'ngram' or 'draft' for it"
            )
        hf_config, parallel = target.config.hf_config, target.config.parallel
        count = int(hf_config.get("num_nextn_predict_layers") or 0)
        if count > 1:
            logger.info("mtp: the checkpoint has %d MTP layers; proposals chain through mtp.0", count)
            count = 1
        if count < 1:
            raise ValueError(
                f"[engine.speculative] method = 'mtp': the checkpoint's num_nextn_predict_layers is {count}; it has "
                "no multi-token-prediction layers (mtp.*) to propose with: use 'ngram' or 'draft'"
            )
        if self.config.num_speculative_tokens > self.config.block_size + 1:
            raise ValueError(
                f"[engine.speculative] num_speculative_tokens = {self.config.num_speculative_tokens}: the 'mtp' "
                f"speculator's window ring keeps at most engine.block_size + 1 = {self.config.block_size + 1} "
                "entries past its window; lower num_speculative_tokens or raise block_size"
            )
        moe = int(hf_config.get("n_routed_experts", 256) or 0) > 0
        self.layout = draft_parallel_config(
            parallel, tensor_parallel_size=parallel.tensor_parallel_size, pipeline_parallel_size=1, draft_is_moe=moe
        )
        s = mtp_settings(hf_config, self.layout)
        s.check()
        device, dtype = target.device, getattr(torch, target.config.dtype)
        with models.building(), torch.device(device), default_dtype(dtype):
            self.layers = [DeepseekV4MTPLayer(s, module, index) for index in range(count)]
        load_dtype = target.family.load_dtype(target.config.dtype)
        for index, layer in enumerate(self.layers):
            weights = models.weights(load_dtype)
            try:
                load_parameters(layer, weights, lambda name, index=index: mtp_parameter_name(name, index))
            except ValueError as error:
                raise ValueError(f"[engine.speculative] method = 'mtp', layer mtp.{index}: {error}") from error
            layer.wire()
            layer.eval()
        module.model.keep_streams = True
        spec = SlidingWindowSpec(
            block_size=self.config.block_size,
            dtype=target.config.dtype,
            num_kv_heads=1,
            head_dim=s.head_dim,
            window=s.sliding_window,
            ring=True,
        )
        for layer in self.layers:
            layer.ring_blocks = spec.ring_blocks
        self._keep = s.sliding_window + self.config.num_speculative_tokens
        """Target positions kept per request: the window a proposal attends, and the rows a step may reject."""
        self._groups = (KVCacheGroupSpec(GROUP, tuple(layer_name(index) for index in range(count)), spec),)
        self._backend, self._device = target.backend, device
        logger.debug(
            "mtp: %d layer(s), tensor_parallel_size %d, enable_expert_parallel %s",
            count,
            self.layout.tensor_parallel_size,
            self.layout.enable_expert_parallel,
        )

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self._groups

    def kv_cache_shape(self, spec: Any, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, spec.block_size, spec.head_dim)  # keys are the values: one tensor per slot

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._inputs = InputBuilder(self._backend, self._groups, kv_caches, self._device, None, None)

    def add_request(self, request: SpeculationRequest) -> None:
        self.requests[request.request_id] = _Followed([*request.prompt_token_ids, *request.output_token_ids])

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def take_hidden_states(self, states: TargetHiddenStates) -> None:
        row = 0
        for request_id, start, count in zip(states.request_ids, states.starts, states.counts, strict=True):
            rows, row = states.hidden[row : row + count], row + count
            followed = self.requests.get(request_id)
            if followed is None or count == 0:
                continue
            if followed.first is None or start < followed.first + followed.done or start > followed.rows_end:
                # First sight (from position 0, or past a prefix hit), or not where it left off: start afresh.
                followed.first, followed.done, followed.rows, followed.rows_start = start, 0, [], start
            followed.keep_rows_before(start)
            followed.rows.append(rows)
            # An entry's key is a function of its own inputs, and a proposal attends the last `window` entries
            # only: older rows are skipped (counted as done, never computed), which bounds what a long prompt, or
            # a request that never proposes (a constrained one), keeps and what its catch-up computes.
            surplus = followed.rows_end - followed.rows_start - self._keep
            if surplus > 0 and followed.rows_start == followed.first + followed.done:
                followed.take_rows_before(followed.rows_start + surplus)
                followed.done += surplus
            followed.rows[-1] = followed.rows[-1].clone()  # not a view pinning the forward's whole tensor

    def on_verified(self, results: Sequence[Verified]) -> None:
        for result in results:
            followed = self.requests.get(result.request_id)
            if followed is None:
                continue
            followed.token_ids.extend(result.token_ids)
            if result.num_proposed:
                # The target verified positions up to the one before its newest token; later rows were rejected
                # (no later forward holds the request: its next step waited for these proposals).
                followed.keep_rows_before(len(followed.token_ids) - 1)

    @torch.inference_mode()
    def propose(self, step: ProposalStep) -> Proposals:
        assert self.layers and self._inputs is not None, "load and bind_kv_caches come first"
        assert step.draft_inputs is not None, "the runner passes a model-owning speculator its rows' blocks"
        proposals: list[list[int]] = [[] for _ in step.request_ids]
        picked: list[tuple[int, _Followed, _Row, int]] = []
        feeds: list[torch.Tensor] = []
        spec = self._groups[0].spec
        for index, (request_id, limit) in enumerate(zip(step.request_ids, step.max_tokens, strict=True)):
            followed = self.requests.get(request_id)
            if followed is None or limit <= 0 or followed.first is None:
                continue
            newest = len(followed.token_ids) - 1  # entries reach the target position before it
            caught_up = followed.rows_start >= newest
            if followed.rows_start != followed.first + followed.done or followed.rows_end < newest or caught_up:
                continue  # streams missing (a forward it was not in): it decodes plainly, and starts afresh later
            blocks = [list(table) for table in step.draft_inputs.block_ids[index]]
            last = newest - 1 - followed.first  # the newest entry's position: the first proposal comes from it
            table = len(blocks[0])
            room = limit if table >= spec.ring_blocks else table * spec.block_size - last
            count = min(limit, room)
            if count <= 0:
                continue
            tokens = followed.token_ids[followed.first + 1 :]
            picked.append((index, followed, _Row(request_id, tokens, followed.done, blocks), count))
            feeds.extend(followed.take_rows_before(newest))
            followed.done = len(tokens)
        if not picked:
            return Proposals(proposals)
        made = self._draft(torch.cat(feeds), [entry[2] for entry in picked], [entry[3] for entry in picked])
        for (index, _, _, count), tokens in zip(picked, made, strict=True):
            proposals[index] = tokens[:count]
        return Proposals(proposals)

    def _draft(self, previous: torch.Tensor, rows: list[_Row], wanted: list[int]) -> list[list[int]]:
        """Each row's ``wanted`` greedy tokens: a catch-up forward over the entries its cache lacks (``previous``:
        the target's streams there, rows end to end), then one forward per further token, fed the last entry's
        output streams and the token it proposed."""
        device, vocab = self._device, self.config.vocab_size or None
        counts = [len(row.token_ids) - row.num_computed_tokens for row in rows]
        input_ids, positions, context, query_start = self._inputs.build(rows, counts, known_only)
        layer = self.layers[0]
        streams = layer(input_ids, positions, previous, context)
        last = torch.tensor([end - 1 for end in query_start[1:]], dtype=torch.long, device=device)
        streams = streams[last]
        drafted = [greedy_in_vocabulary(layer.compute_logits(streams), vocab)]
        active = list(range(len(rows)))
        for step in range(1, max(wanted)):
            keep = [position for position, row in enumerate(active) if wanted[row] > step]
            active = [active[position] for position in keep]
            kept = torch.tensor(keep, dtype=torch.long, device=device)
            chosen = torch.tensor(active, dtype=torch.long, device=device)
            # Entry ``len(token_ids) + step - 1`` reads the last proposal and the entry before's streams.
            fed = [
                _Row(rows[r].request_id, rows[r].token_ids, len(rows[r].token_ids) + step - 1, rows[r].block_ids)
                for r in active
            ]
            tokens = drafted[-1][chosen]

            def fill(input_ids: torch.Tensor, _states: list, _counts: list, tokens: torch.Tensor = tokens) -> None:
                input_ids.copy_(tokens)

            input_ids, positions, context, _ = self._inputs.build(fed, [1] * len(fed), fill)
            streams = layer(input_ids, positions, streams[kept].flatten(1), context)
            proposed = torch.zeros(len(rows), dtype=torch.long, device=device)
            proposed[chosen] = greedy_in_vocabulary(layer.compute_logits(streams), vocab)
            drafted.append(proposed)
        table = torch.stack(drafted, dim=1).tolist()
        return [row[:count] for row, count in zip(table, wanted, strict=True)]
