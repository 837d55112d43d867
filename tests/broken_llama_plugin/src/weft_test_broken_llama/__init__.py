"""The Llama family with one defect: it reads the rope base as ten times the checkpoint's.

Registered as ``BrokenLlamaForCausalLM``, a name of its own, for checkpoints holding Llama
weights; it names transformers' ``LlamaForCausalLM`` as its reference, so ``weft verify``
compares it with the model it claims to reproduce (tests/test_verify.py).
"""

from __future__ import annotations

import msgspec
import torch

from weft.contracts.model import ModelConfig
from weft.layers.rotary import rope_parameters
from weft.models.llama import LlamaFamily, LlamaForCausalLM


class BrokenLlamaFamily(LlamaFamily):
    def hf_architecture(self, architecture: str) -> str:
        return "LlamaForCausalLM"

    def build(self, config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
        rope = rope_parameters(config.hf_config)
        wrong = {**config.hf_config, "rope_parameters": {**rope, "rope_theta": 10 * float(rope["rope_theta"])}}
        return super().build(msgspec.structs.replace(config, hf_config=wrong), device)
