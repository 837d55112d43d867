"""DeepSeek V4 (``DeepseekV4ForCausalLM``): the decoder stack and the model family, following Hugging
Face's ``modeling_deepseek_v4.py`` and DeepSeek's causal inference semantics. Each part lives in its
own module:

``config``      the validated ``config.json`` numbers, layer types, their KV-cache groups
``rope``        partial interleaved RoPE (main, and compressed-branch with YaRN)
``compressor``  pools every ``m`` tokens into one entry; its partial window is recurrent state
``indexer``     the lightning indexer's scores over a CSA layer's entries
``attention``   window ring + compressed entries + per-head sink, grouped low-rank output
``attention_kernel``  decode attention in one Triton kernel (CUDA and XPU; the torch path elsewhere)
``mhc``         hyper-connections: ``hc_mult`` residual streams, Sinkhorn-normalised mixing
``moe``         router (hash or scored), routed experts, shared expert
``weights``     checkpoint tensor names <-> this module's parameters (one map, both ways)
``step``        a step's requests as the layers read them

Every layer attends over a sliding window of its own keys (shared-KV MQA, one head used as
key and value) plus, on CSA and HCA layers, compressed entries: one per ``m`` source tokens,
pooled by a compressor. CSA layers attend only the entries the lightning indexer picks
(``decode_topk``); HCA layers attend every visible entry. A per-head sink joins the softmax.
The residual is ``hc_mult`` streams mixed by mHC around every sub-block.

The engine's paged attention backend is not used: the model keeps its own per-request
state in five KV-cache groups (see :class:`DeepseekV4Family.kv_cache_groups`):

``window``            the last keys of each layer, a ring of blocks (not prefix-cacheable)
``csa_kv``            CSA compressed entries, one per 4 tokens (prefix-cacheable)
``hca_kv``            HCA compressed entries, one per ``m'`` tokens (prefix-cacheable)
``indexer_keys``      the indexer's compressed keys on CSA layers (prefix-cacheable)
``compressor_state``  the projected ``(kv, gate)`` of the last ``2m`` (CSA) or ``m'`` (HCA) tokens,
                      fp32, a ring indexed by position: the incomplete window and the CSA overlap
                      half-window carried between steps (recurrent; not prefix-cacheable)

Several ranks (``tensor_parallel_size``): each rank holds its attention heads (with their
output groups and sinks), its share of the shared expert's columns and of the vocabulary;
the shared key/value head, the compressors, the indexer, mHC and the router are computed
alike on every rank (their KV-cache groups are the same on every rank). Routed experts are
either split the same way (each expert's columns: every rank routes every token, adds what
its columns give, and one all-reduce per layer sums the ranks' shares) or, with
``enable_expert_parallel``, spread whole over the ranks, the tokens exchanged between them
(core's ``weft.layers.moe.ExpertParallelExchange``: each rank routes its shard of the tokens, the routing is
all-gathered, the outputs reduce-scattered to their shard's rank and all-gathered back).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import nn

from weft.api import (
    DecodeTopKTorch,
    ForwardContext,
    ParallelLMHead,
    VocabParallelEmbedding,
    copy_checked,
    current_op,
    default_dtype,
)
from weft.contracts.kv_cache import (
    CheckpointSpec,
    CompressedSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from weft.contracts.loader import as_slice
from weft.contracts.model import ModelConfig, ModelFamily
from weft_dsv4.attention import DeepseekV4Attention, decode_attention_kernel, prefill_attention_kernel
from weft_dsv4.compressor import EntryFormat, Fp8EntryFormat
from weft_dsv4.config import CSA, HCA, DeepseekV4Settings, layer_groups
from weft_dsv4.mhc import HyperConnection, HyperHead, fused_kernel
from weft_dsv4.moe import Experts, MoE
from weft_dsv4.norm import RMSNorm
from weft_dsv4.rope import InterleavedRope
from weft_dsv4.step import StepLayout
from weft_dsv4.weights import parameter_name

FULL_WIDTH_DECODE_MAX_LEN = 16384
FULL_WIDTH_DECODE_ROW_TOKENS = FULL_WIDTH_DECODE_MAX_LEN * 512
"""Where ``max_model_len`` is at most ``FULL_WIDTH_DECODE_MAX_LEN``, or ``max_model_len`` times ``max_num_seqs``
(the largest decode batch) at most ``FULL_WIDTH_DECODE_ROW_TOKENS`` (what 512 rows of 16,384 tokens hold),
decode graphs are captured (on a device where they can be), and there decode reads each request's compressed
entries padded to every entry ``max_model_len`` allows, eagerly too (the same shapes, so graphs on and off give
the same tokens). A graph's decode does work and holds activations in proportion to ``max_model_len`` times its
rows (CSA's entries and indexer keys of every row of the largest batch), which the KV-cache budget does not
reserve; beyond both bounds decode runs eagerly over each batch's longest request."""


def full_width_decode(config: ModelConfig) -> bool:
    """Whether decode pads every row to ``max_model_len`` (and so may be captured): see
    ``FULL_WIDTH_DECODE_MAX_LEN``."""
    if config.max_model_len <= FULL_WIDTH_DECODE_MAX_LEN:
        return True
    return 0 < config.max_num_seqs and config.max_model_len * config.max_num_seqs <= FULL_WIDTH_DECODE_ROW_TOKENS


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, s: DeepseekV4Settings, index: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(s, index)
        self.mlp = MoE(s, index)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn_hc = HyperConnection(s)
        self.ffn_hc = HyperConnection(s)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ropes: dict[str, InterleavedRope],
        step: StepLayout,
    ) -> torch.Tensor:
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
        self.decode_width_tokens = 0
        """Decode pads every group's block tables to this many tokens' blocks (0: to the batch's longest)."""
        self.embed_tokens = VocabParallelEmbedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(s, index) for index in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hc_head = HyperHead(s)
        self.ropes = nn.ModuleDict(
            {name: InterleavedRope(s.rope[name], s.head_dim, max_positions) for name in ("main", "compress")}
        )
        self.keep_streams = False
        """Keep the last forward's residual streams (``last_streams``): set by the MTP speculator, which reads them."""
        self.last_streams: torch.Tensor | None = None
        """``[T, hc_mult, hidden]``: the streams before ``hc_head`` of the last forward, where ``keep_streams``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        step = StepLayout(context, self.group_names, self.ring_blocks, self.decode_width_tokens)
        for hit, tables in step.restores:
            for layer in self.layers:
                layer.self_attn.restore(step, hit, tables)
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        ropes = dict(self.ropes.items())
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, ropes, step)
        if self.keep_streams:
            self.last_streams = streams
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

    def hidden_states_for_speculation(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a speculator reads of the forward that returned ``hidden``: the residual streams before ``hc_head``,
        ``[T, hc_mult * hidden]`` (DeepSeek's MTP layers take them, not the collapsed, normed state)."""
        streams = self.model.last_streams
        assert streams is not None and streams.shape[0] == hidden.shape[0], "set model.keep_streams before the forward"
        return streams.flatten(1)


class DeepseekV4Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[plugins.DeepseekV4ForCausalLM]`` in weft.toml."""

    indexer_key_dtype: Annotated[
        Literal["auto", "fp8_e4m3"],
        msgspec.Meta(
            description=(
                "how the lightning indexer's compressed keys are stored: 'auto' in the model's dtype (transformers' "
                "numbers), 'fp8_e4m3' as DeepSeek's own inference does, float8 with a float32 scale per key: under "
                "half a bf16 cache's bytes for that group, which every CSA layer scores in full each step (it stays "
                "on the GPU under weft-hisparse), at a small change to the indexer's scores and so, near ties, to its "
                "picks"
            )
        ),
    ] = "auto"


class DeepseekV4Family(ModelFamily):
    """DeepSeek V4 / V4.1 (``DeepseekV4ForCausalLM``): CSA/HCA compressed sparse attention, mHC, hash MoE."""

    reads_weight_slices = True
    Options = DeepseekV4Options

    @property
    def indexer_key_format(self) -> EntryFormat:
        return Fp8EntryFormat() if self.options.indexer_key_dtype == "fp8_e4m3" else EntryFormat()

    def captures_managed_groups(self, config: ModelConfig, device: torch.device) -> bool:
        """Decode graphs: the layers read a graph's static buffers on the device only (``StepLayout`` with
        ``static_decode``). Not where the routed experts fall back to a matmul per expert (its row counts
        come from the host): CUDA without torch's grouped GEMM for this dtype (before sm90, or float32)."""
        if config.parallel.world_size > 1:
            return False  # TP/PP collectives of the family are not captured yet
        if not full_width_decode(config):
            return False  # a graph's decode reads every entry max_model_len allows: eager reads each request's own
        from weft.api import grouped_mm_runs

        s = DeepseekV4Settings(config.hf_config, config.parallel)
        hidden, columns = s.hidden_size, s.expert_intermediate

        def runs(inputs: int, outputs: int) -> bool:  # only the shapes matter: expanded, nothing allocated
            rows = torch.empty((1, 1), dtype=getattr(torch, config.dtype), device=device).expand(1, inputs)
            return grouped_mm_runs(rows, rows.new_empty((1, 1, 1)).expand(1, outputs, inputs))

        return runs(hidden, 2 * columns) and runs(columns, hidden)

    def kv_cache_groups(self, config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
        s = DeepseekV4Settings(config.hf_config, lookahead=config.num_lookahead_tokens)
        block_size = config.block_size
        kinds = s.layer_types

        def names(group: str) -> tuple[str, ...]:
            return tuple(
                f"model.layers.{i}.self_attn.{group}" for i, kind in enumerate(kinds) if group in layer_groups(kind)
            )

        def compressed_block(ratio: int) -> int:
            return math.lcm(block_size, ratio)

        checkpointed = config.enable_prefix_caching
        groups = [
            KVCacheGroupSpec(
                "window",
                names("window"),
                SlidingWindowSpec(
                    block_size=block_size,
                    dtype=config.dtype,
                    num_kv_heads=1,
                    head_dim=s.head_dim,
                    window=s.sliding_window,
                    ring=True,
                ),
                checkpointed=checkpointed,
            ),
        ]
        if CSA in kinds:
            ratio = s.ratio(CSA)
            groups.append(
                KVCacheGroupSpec(
                    "csa_kv",
                    names("csa_kv"),
                    CompressedSpec(
                        block_size=compressed_block(ratio),
                        dtype=config.dtype,
                        compress_ratio=ratio,
                        entry_dim=s.head_dim,
                    ),
                )
            )
        if HCA in kinds:
            ratio = s.ratio(HCA)
            groups.append(
                KVCacheGroupSpec(
                    "hca_kv",
                    names("hca_kv"),
                    CompressedSpec(
                        block_size=compressed_block(ratio),
                        dtype=config.dtype,
                        compress_ratio=ratio,
                        entry_dim=s.head_dim,
                    ),
                )
            )
        if CSA in kinds:
            ratio = s.ratio(CSA)
            key_format = self.indexer_key_format
            groups.append(
                KVCacheGroupSpec(
                    "indexer_keys",
                    names("indexer_keys"),
                    CompressedSpec(
                        block_size=compressed_block(ratio),
                        dtype=key_format.cache_dtype(config.dtype),
                        compress_ratio=ratio,
                        entry_dim=key_format.row_width(s.index_head_dim),
                    ),
                )
            )
        if CSA in kinds or HCA in kinds:
            elements = max(s.state_elements(kind) for kind in kinds)
            groups.append(
                KVCacheGroupSpec(
                    "compressor_state",
                    names("compressor_state"),
                    RecurrentStateSpec(
                        block_size=block_size,
                        dtype="float32",
                        state_elements=elements,
                    ),
                    checkpointed=checkpointed,
                )
            )
        if checkpointed:
            # Snapshots of the ring (the last `window` keys) and of the compressor state at every
            # boundary of the manager's hash unit, so that a prefix hit can resume exactly there.
            unit = math.lcm(*(group.spec.block_size for group in groups))
            groups.append(
                KVCacheGroupSpec(
                    "window_checkpoint",
                    names("window_checkpoint"),
                    CheckpointSpec(
                        block_size=unit,
                        dtype=config.dtype,
                        state_elements=s.sliding_window * s.head_dim,
                    ),
                )
            )
            if CSA in kinds or HCA in kinds:
                groups.append(
                    KVCacheGroupSpec(
                        "state_checkpoint",
                        names("state_checkpoint"),
                        CheckpointSpec(
                            block_size=unit,
                            dtype="float32",
                            state_elements=elements,
                        ),
                    )
                )
        return tuple(groups)

    def kv_cache_shape(self, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        if isinstance(spec, SlidingWindowSpec):  # keys are the values: one tensor per slot
            return (num_blocks, spec.block_size, spec.head_dim)
        if isinstance(spec, CompressedSpec):
            return (num_blocks, spec.block_size // spec.compress_ratio, spec.entry_dim)
        if isinstance(spec, (RecurrentStateSpec, CheckpointSpec)):
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
        s = DeepseekV4Settings(config.hf_config, config.parallel, config.num_lookahead_tokens)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = DeepseekV4ForCausalLM(s, config.max_model_len)
        groups = self.kv_cache_groups(config)
        module.model.group_names = tuple(group.name for group in groups)
        module.model.ring_blocks = groups[0].spec.ring_blocks
        if device.type != "cpu" and self.captures_managed_groups(config, device):
            # Eager decode in the shapes of a graph's (also under enforce_eager), so graphs on and off agree.
            module.model.decode_width_tokens = config.max_model_len
        topk = current_op("decode_topk") or DecodeTopKTorch(None)
        mhc_kernel = fused_kernel(device, s.hc_mult)
        decode_kernel = decode_attention_kernel(device, getattr(torch, config.dtype), s.head_dim)
        prefill_kernel = prefill_attention_kernel(device, getattr(torch, config.dtype), s.head_dim)
        key_format = self.indexer_key_format
        for layer in module.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.compressor.format = key_format
            layer.self_attn.topk_op = topk
            layer.self_attn.decode_kernel = decode_kernel
            layer.self_attn.prefill_kernel = prefill_kernel
            layer.attn_hc.kernel = layer.ffn_hc.kernel = mhc_kernel
        module.model.ropes.to(device)
        return module.eval()

    def load_weights(self, module: nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        """Whole tensors or :class:`~weft.contracts.loader.WeightSlice` objects: each rank reads its part
        (its heads, columns and vocabulary rows; under expert parallelism only its experts). The checkpoint's
        multi-token-prediction layers (``mtp.*``) are the ``mtp`` speculator's (:mod:`weft_dsv4.mtp`)."""
        load_parameters(module, weights, lambda name: None if is_mtp_tensor(name) else parameter_name(name))


def is_mtp_tensor(checkpoint_name: str) -> bool:
    """Whether a checkpoint tensor belongs to the multi-token-prediction layers (``mtp.N.*``, or with ``model.``)."""
    return checkpoint_name.startswith("mtp.") or ".mtp." in checkpoint_name


def load_parameters(
    module: nn.Module,
    weights: Iterable[tuple[str, Any]],
    name_of: Callable[[str], tuple[str, int | None, str | None] | None],
) -> None:
    """Fill every parameter of ``module`` (and its router tables) from ``weights``; ``name_of`` gives a checkpoint
    tensor's ``(parameter, expert, part)`` (:func:`weft_dsv4.weights.parameter_name`), None for one to skip.
    Raises ValueError naming a tensor without a parameter, or the parameters no tensor filled."""
    targets = dict(module.named_parameters())
    tables = ("tid2eid", "e_score_correction_bias")
    targets.update((name, buffer) for name, buffer in module.named_buffers() if name.endswith(tables))
    filled: set[str] = set()
    for checkpoint_name, tensor in weights:
        named = name_of(checkpoint_name)
        if named is None:
            continue
        if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"checkpoint tensor {checkpoint_name!r} is {tensor.dtype}: quantised DeepSeek V4 checkpoints are "
                "not supported yet; dequantise it to bfloat16 first"
            )
        name, expert, part = named
        if name not in targets:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} has no parameter in {type(module).__name__}")
        owner_name, _, parameter = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if isinstance(owner, Experts):
            if expert is None:
                owner.load_stacked("down" if parameter == "down_proj" else "gate_up", tensor, checkpoint_name)
                filled.add(name)
            elif owner.holds(expert):  # another rank's expert is never read
                owner.load_expert(expert, part, tensor, checkpoint_name)
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
            held = range(experts.held.first, experts.held.first + experts.held.count)
            expected |= {f"{name}#{e}.{p}" for e in held for p in parts}
        else:
            expected.add(name)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} parameter(s), e.g. {missing[:3]}")
