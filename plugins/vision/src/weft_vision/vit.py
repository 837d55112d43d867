"""The ViT encoder layers of CLIP and SigLIP vision towers (LLaVA-Next's and Idefics3's), in plain torch.

Both are pre-norm transformer layers: ``layer_norm1``, attention with ``q_proj``/``k_proj``/``v_proj``/
``out_proj`` (all with biases, bidirectional, scale ``head_dim ** -0.5``), ``layer_norm2``, and an MLP ``fc1``,
activation, ``fc2``; CLIP's activation is ``quick_gelu``, SigLIP's ``gelu_pytorch_tanh``. Parameter names are
transformers', so a tower's checkpoint tensors load by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weft_vision.common import Linear, attention

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "silu": nn.functional.silu,
}


def activation(name: str) -> Any:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act = {name!r} is not supported here; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class ViTAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj = Linear(hidden, hidden), Linear(hidden, hidden), Linear(hidden, hidden)
        self.out_proj = Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = (*hidden.shape[:2], self.heads, self.head_dim)
        query, key, value = (projection(hidden).view(shape) for projection in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attention(query, key, value, self.head_dim**-0.5))


class ViTMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = Linear(hidden, intermediate), Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(hidden)))


class ViTLayer(nn.Module):
    def __init__(self, config: dict[str, Any], default_act: str, default_eps: float) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", default_eps)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = ViTAttention(hidden, config["num_attention_heads"])
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = ViTMLP(hidden, config["intermediate_size"], config.get("hidden_act", default_act))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class ViTEncoder(nn.Module):
    def __init__(self, config: dict[str, Any], default_act: str, default_eps: float, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ViTLayer(config, default_act, default_eps) for _ in range(layers))
