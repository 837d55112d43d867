"""Hugging Face's ``DeepseekV4ForCausalLM`` as a correctness reference, and a direct driver of
Weft's DeepSeek V4 module over its KV-cache groups (every position's logits, any chunking).

Used by the plugin's tests and ``bench/gpu_dsv4.py``; imports transformers only when called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from weft.api import ForwardContext, KVCacheManager, using_ops
from weft.contracts.attention import AttentionBatch
from weft.contracts.model import ModelConfig


@contextlib.contextmanager
def fp8_indexer_keys() -> Iterator[None]:
    """transformers' indexer scoring its keys rounded as ``indexer_key_dtype = "fp8_e4m3"`` stores them
    (``Fp8EntryFormat``: float8 with a scale per key), the reference for that option."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    from weft_dsv4.compressor import Fp8EntryFormat

    scorer, key_format = modeling_deepseek_v4.DeepseekV4IndexerScorer, Fp8EntryFormat()
    score = scorer.forward

    def rounded_keys(self, q, compressed_kv, hidden_states):  # type: ignore[no-untyped-def]
        keys = key_format.decode(key_format.encode(compressed_kv, torch.uint8)).to(compressed_kv.dtype)
        return score(self, q, keys, hidden_states)

    scorer.forward = rounded_keys
    try:
        yield
    finally:
        scorer.forward = score


@contextlib.contextmanager
def stable_topk() -> Iterator[None]:
    """Make ``Tensor.topk`` break ties toward the lower index (a stable descending sort).

    transformers' indexer calls ``scores.topk``; on the CPU torch's tie order depends on the row
    length, which makes its prefill look non-causal. Any stable top-k is still a top-k, so the
    patch changes nothing else it is used for.
    """
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def random_hf_model(
    config_kwargs: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Any:
    """A ``DeepseekV4ForCausalLM`` with random weights large enough to matter (sinks, biases, routing)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV4Config(**config_kwargs)
    model = DeepseekV4ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                parameter.copy_(1 + torch.rand(parameter.shape, generator=generator))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(("fn", "hc_fn")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = config.n_routed_experts
                choice = torch.stack(
                    [torch.randperm(experts, generator=generator)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
                )
                buffer.copy_(choice)
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model.to(device=device, dtype=dtype).eval()


def save_checkpoint(model: Any, folder: Path) -> Path:
    """``save_pretrained`` (transformers writes DeepSeek's own tensor names)."""
    model.save_pretrained(str(folder))
    return folder


class Driver:
    """Runs Weft's DeepSeek V4 module over its KV-cache groups, one request at a time or batched,
    building each step's per-group block tables and slots exactly as the model runner does."""

    def __init__(
        self,
        folder: Path,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 8,
        max_model_len: int = 512,
        num_blocks: int = 256,
        topk_op: Any = None,
        num_lookahead_tokens: int = 0,
    ) -> None:
        import json

        from weft.api import SafetensorsLoader
        from weft_dsv4.model import DeepseekV4Family

        hf_config = json.loads((Path(folder) / "config.json").read_text())
        self.config = ModelConfig(
            architecture="DeepseekV4ForCausalLM",
            hf_config=hf_config,
            dtype=dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        self.device = torch.device(device)
        self.family = DeepseekV4Family()
        with using_ops({"decode_topk": topk_op} if topk_op is not None else {}):
            self.model = self.family.build(self.config, self.device)
        loader = SafetensorsLoader()
        self.family.load_weights(
            self.model, loader.iter_weights(loader.resolve(str(folder)), self.family.load_dtype(dtype))
        )
        self.groups = self.family.kv_cache_groups(self.config)
        self.manager = KVCacheManager(self.groups, [num_blocks] * len(self.groups), enable_prefix_caching=False)
        self.caches = {}
        for group in self.groups:
            shape = self.family.kv_cache_shape(group.spec, num_blocks)
            for layer in group.layer_names:
                self.caches[layer] = torch.zeros(shape, dtype=getattr(torch, group.spec.dtype), device=self.device)
        self.lengths: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Feed each request its next tokens; returns each request's logits ``[len(chunk), vocab]``."""
        token_ids, positions, query_start, seq_lens = [], [], [0], []
        for request_id, chunk in chunks:
            start = self.lengths.get(request_id, 0)
            end = start + len(chunk)
            if not self.manager.allocate_slots(request_id, end):
                raise RuntimeError("the driver's KV cache is full")
            self.lengths[request_id] = end
            token_ids.extend(chunk)
            positions.extend(range(start, end))
            query_start.append(len(token_ids))
            seq_lens.append(end)
        device = self.device
        position_tensor = torch.tensor(positions, device=device)
        query_start_tensor = torch.tensor(query_start, dtype=torch.int32, device=device)
        rows = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), query_start_tensor.diff().long())
        batches = []
        for index, group in enumerate(self.groups):
            tables = [self.manager.block_ids(request_id, (index,))[0] for request_id, _ in chunks]
            width = max(len(table) for table in tables)
            block_table = torch.tensor(
                [list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
            )
            batches.append(
                AttentionBatch(
                    query_start=query_start_tensor,
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                    block_table=block_table,
                    slot_mapping=group.spec.slot_mapping(block_table, rows, position_tensor).to(torch.int32),
                    max_query_len=max(len(chunk) for _, chunk in chunks),
                    max_seq_len=max(seq_lens),
                    block_size=group.spec.block_size,
                )
            )
        context = ForwardContext(
            backend=None, metadata=[None] * len(self.groups), kv_caches=self.caches, batches=batches
        )
        hidden = self.model(torch.tensor(token_ids, device=device), position_tensor, context)
        logits = self.model.compute_logits(hidden).float()
        return [logits[a:b] for a, b in zip(query_start, query_start[1:], strict=False)]

    def roll_back(self, request_id: str, count: int) -> None:
        """Forget the last ``count`` tokens fed (rejected proposals): the next step computes from there."""
        self.lengths[request_id] -= count

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)
        self.lengths.pop(request_id, None)
