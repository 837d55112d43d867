"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: ``Phi3ForCausalLM``), following HF's ``modeling_phi3.py``.

A Llama-architecture decoder (:mod:`weft.models.llama`) with three differences:
- the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``; each fused tensor is
  read as its parts, so a tensor-parallel rank still reads only its rows of each;
- LongRoPE: short factors while a sequence is within ``original_max_position_embeddings``, long factors
  once it is longer, both tables scaled by the attention factor. The choice is made per request at each
  step from its length after the step, as HF chooses for the whole sequence; unlike HF, which recomputes
  the cache when a sequence crosses the limit, keys cached before the crossing keep their short rotation
  (vLLM does the same);
- a rotation of the leading ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75).

Tensor and pipeline parallelism as the Llama family.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weft.contracts.loader import WeightSlice, as_slice
from weft.contracts.model import ModelConfig
from weft.contracts.parallel import ParallelLayout
from weft.layers.attention import ForwardContext
from weft.layers.linear import default_dtype
from weft.layers.rotary import LongRopeEmbedding, rotary_dim
from weft.models.llama import LlamaFamily, LlamaForCausalLM, LlamaSettings


class RowRange(WeightSlice):
    """Rows ``start .. start + length - 1`` of a stored tensor (one part of a fused checkpoint tensor)."""

    def __init__(self, base: WeightSlice, start: int, length: int) -> None:
        self.base, self.start = base, start
        self.shape = (length, *base.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self.base.narrow(0, self.start + start, length)
        return self.load().narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self.base.narrow(0, self.start, self.shape[0])


class Phi3Settings(LlamaSettings):
    """Llama's numbers, with the rope settings gathered as HF's ``Phi3Config`` does."""

    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        super().__init__(config, architecture, layout)
        rope = self.rope
        if rope["rope_type"] in ("su", "yarn"):  # earlier names of LongRoPE in Phi-3 configs
            rope["rope_type"] = "longrope"
        rope.setdefault("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        if rope["rope_type"] == "longrope":
            rope["original_max_position_embeddings"] = config.get(
                "original_max_position_embeddings",
                rope.get("original_max_position_embeddings"),
            )
            rope["max_position_embeddings"] = self.max_position_embeddings


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, settings: Phi3Settings, max_positions: int) -> None:
        super().__init__(settings, max_positions)
        self.long_rope = settings.rope["rope_type"] == "longrope"
        if self.long_rope:
            self.model.rotary = LongRopeEmbedding(settings.head_dim, max_positions, settings.rope)
        self.max_positions = max_positions
        if rotary_dim(settings.head_dim, settings.rope) < settings.head_dim:
            for index in settings.stage_layers:  # the rotary op turns whole heads; a partial turn is apply_rotary's
                self.model.layers[index].self_attn.rotary = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.long_rope:
            positions = positions + self.max_positions * self._long_tokens(positions, context)
        return super().forward(input_ids, positions, context, intermediate)

    def _long_tokens(self, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """1 for each token whose request will be longer than the original context after this step, else 0."""
        batch = context.batches[0]
        seq_lens = batch.seq_lens
        if seq_lens.shape[0] != positions.shape[0]:  # some request has several tokens: spread its length over them
            seq_lens = torch.repeat_interleave(seq_lens, batch.query_start.diff(), output_size=positions.shape[0])
        return (seq_lens > self.model.rotary.original_max_positions).to(positions.dtype)


class Phi3Family(LlamaFamily):
    """``Phi3ForCausalLM``: the Llama family's layers with fused checkpoint tensors and LongRoPE."""

    def build(self, config: ModelConfig, device: torch.device) -> Phi3ForCausalLM:
        settings = Phi3Settings(config.hf_config, config.architecture, config.parallel)
        with torch.device(device), default_dtype(getattr(torch, config.dtype)):
            module = Phi3ForCausalLM(settings, config.max_model_len)
        module.model.rotary.to(device)
        return module.eval()

    def load_weights(self, module: torch.nn.Module, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(module, _split_fused(weights, module.settings))


def _split_fused(weights: Iterable[tuple[str, Any]], settings: LlamaSettings) -> Iterator[tuple[str, Any]]:
    """Each fused ``qkv_proj`` / ``gate_up_proj`` tensor as the q/k/v or gate/up tensors the Llama family reads."""
    q_size, kv_size = settings.num_heads * settings.head_dim, settings.num_kv_heads * settings.head_dim
    parts = {
        "qkv_proj": (("q_proj", 0, q_size), ("k_proj", q_size, kv_size), ("v_proj", q_size + kv_size, kv_size)),
        "gate_up_proj": (
            ("gate_proj", 0, settings.intermediate_size),
            ("up_proj", settings.intermediate_size, settings.intermediate_size),
        ),
    }
    for name, tensor in weights:
        fused = name.split(".")[-2]
        if fused not in parts:
            yield name, tensor
            continue
        stored = as_slice(tensor)
        expected = parts[fused][-1][1] + parts[fused][-1][2]
        if stored.shape[0] != expected:
            raise ValueError(f"checkpoint tensor {name!r} has {stored.shape[0]} rows, expected {expected}")
        for part, start, length in parts[fused]:
            yield name.replace(fused, part), RowRange(stored, start, length)
