"""gpt-oss (``GptOssForCausalLM``): attention with a learned sink per head, sliding-window and full layers
alternating (``layer_types``), YaRN rotary embeddings, and MoE blocks of biased experts with a clamped
gated activation, their weights published in MXFP4.

Following Hugging Face's ``modeling_gpt_oss.py``:
- attention: q/k/v and o projections with biases; the softmax over a query's keys has one more term per
  head, ``exp(sink)``, which carries no value (:attr:`~weft.contracts.attention.AttentionLayer.sinks`);
- router: a linear layer with a bias; a token's top-k logits, softmaxed among themselves (the same as
  a softmax over every expert renormalised over the chosen ones);
- experts: ``gate_up = x W + b`` with gate and up interleaved along the columns, ``gate`` clamped to at
  most ``swiglu_limit`` and ``up`` to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``,
  then the biased down projection.

MXFP4 checkpoints (``*_blocks``: two 4-bit E2M1 values a byte, 32 to a block; ``*_scales``: one E8M0
exponent a block) are dequantized at load on the CPU into the runtime dtype, as transformers does without
its Triton kernels; only the experts a rank holds are dequantized.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from weft.contracts.parallel import ParallelLayout
from weft.layers.moe import FusedMoE, MoEActivation, MoERouting
from weft.layers.rotary import YarnRotaryEmbedding
from weft.models.sparse_moe import (
    SparseMoeBlock,
    SparseMoeDecoderLayer,
    SparseMoeFamily,
    SparseMoeForCausalLM,
    SparseMoeModel,
    SparseMoeSettings,
)

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an E2M1 nibble."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` (uint8, the low nibble first) and ``scales`` ``[..., G]`` (uint8, exponent + 127)
    -> ``[..., G * 32]`` in ``dtype``: each value ``FP4_VALUES[nibble] * 2 ** (scale - 127)``, in float32 first."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]], dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(dtype)


class GptOssSettings(SparseMoeSettings):
    def __init__(self, config: dict[str, Any], architecture: str, layout: ParallelLayout | None = None) -> None:
        super().__init__({"attention_bias": True, **config}, architecture, layout)
        self.output_bias = self.attention_bias
        self.attention_sinks = True
        self.routing = MoERouting(top_k=self.experts_per_token, renormalize=True)
        self.activation = MoEActivation(
            kind="swiglu_oai", limit=config.get("swiglu_limit", 7.0), alpha=config.get("swiglu_alpha", 1.702)
        )


class GptOssDecoderLayer(SparseMoeDecoderLayer):
    def build_mlp(self, settings: GptOssSettings, index: int) -> nn.Module:
        return SparseMoeBlock(settings, settings.activation, router_bias=True, expert_bias=True)


class GptOssModel(SparseMoeModel):
    layer_class = GptOssDecoderLayer
    rotary_class = YarnRotaryEmbedding


class GptOssForCausalLM(SparseMoeForCausalLM):
    model_class = GptOssModel


class GptOssFamily(SparseMoeFamily):
    """gpt-oss checkpoints (gpt-oss-20b, gpt-oss-120b), in MXFP4 as published or dequantized."""

    settings_class = GptOssSettings
    module_class = GptOssForCausalLM
    expert_parts = {}
    stacked_parts = {
        "gate_up_proj": "gate_up",
        "gate_up_proj_bias": "gate_up_bias",
        "down_proj": "down",
        "down_proj_bias": "down_bias",
    }
    checkpoint_names = {".mlp.router.": ".mlp.gate."}
    _quantized = re.compile(r"^(?P<block>.*\.experts)\.(?P<part>gate_up_proj|down_proj)_(?P<kind>blocks|scales)$")

    def load_weights(self, module: nn.Module, weights: Any) -> None:
        self._pending: dict[str, Any] = {}
        super().load_weights(module, weights)
        if self._pending:
            raise ValueError(
                f"the checkpoint has MXFP4 blocks or scales without their pair: {sorted(self._pending)[:3]}"
            )

    def load_other_tensor(self, module: nn.Module, name: str, tensor: Any, filled: set[str]) -> bool:
        quantized = self._quantized.match(name)
        if quantized is not None:
            pair = f"{quantized['block']}.{quantized['part']}_{'scales' if quantized['kind'] == 'blocks' else 'blocks'}"
            if pair not in self._pending:
                self._pending[name] = tensor
                return True
            block: FusedMoE = module.get_submodule(quantized["block"])
            other = self._pending.pop(pair)
            blocks, scales = (tensor, other) if quantized["kind"] == "blocks" else (other, tensor)
            held = slice(block.held.first, block.held.first + block.held.count)
            weight = dequantize_mxfp4(_load(blocks)[held], _load(scales)[held], block.gate_up_proj.dtype)
            # Dequantized, the blocks are the transposed parameter: gate_up [E, 2I, H], down [E, H, I].
            if quantized["part"] == "gate_up_proj":
                block.load_stacked("gate_up", _gate_then_up(weight, dim=1), name, held_only=True)
            else:
                block.load_stacked("down", weight, name, held_only=True)
            return self._count(block, quantized["block"], filled)
        match = self._stacked.match(name)
        if match is None or match["part"] not in self.stacked_parts:
            return False
        block = module.get_submodule(match["block"])
        part = self.stacked_parts[match["part"]]
        value = _load(tensor)
        # transformers' layout: gate_up [E, H, 2I] with gate and up interleaved, down [E, I, H].
        if part == "gate_up":
            value = _gate_then_up(value.transpose(1, 2), dim=1)
        elif part == "gate_up_bias":
            value = _gate_then_up(value, dim=1)
        elif part == "down":
            value = value.transpose(1, 2)
        block.load_stacked(part, value, name)
        return self._count(block, match["block"], filled)

    def _count(self, block: FusedMoE, block_name: str, filled: set[str]) -> bool:
        self._stacked_seen = True
        self._expert_tensors[block_name] = self._expert_tensors.get(block_name, 0) + 1
        filled.update(f"{block_name}.{parameter}" for parameter, _ in block.named_parameters())
        return True


def _load(tensor: Any) -> torch.Tensor:
    return tensor.load() if hasattr(tensor, "load") else tensor


def _gate_then_up(interleaved: torch.Tensor, dim: int) -> torch.Tensor:
    """Columns ``g0 u0 g1 u1 ...`` along ``dim`` -> ``g0 g1 ... u0 u1 ...``."""
    pairs = interleaved.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)
