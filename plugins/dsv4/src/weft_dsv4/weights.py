"""Checkpoint tensor names <-> this module's parameters: one table, read both ways.

A DeepSeek V4 checkpoint names its tensors DeepSeek's way (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.7.w1.weight``); transformers saves V4 under those names too, behind a
``model.`` prefix, except a few it writes under its own module names (``model.embed_tokens.weight``).
:func:`parameter_name` reads any of them (DeepSeek's, with or without ``model.``; transformers'
module names; ours); :func:`checkpoint_name` writes DeepSeek's release name of a parameter.
"""

from __future__ import annotations

import re

# (DeepSeek's name, ours). ``{layer}`` and ``{expert}`` stand for indices; an expert's w1/w3/w2
# are the gate/up/down parts of our stacked ``gate_up_proj``/``down_proj``.
NAMES: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
    ("layers.{layer}.attn_norm.weight", "model.layers.{layer}.input_layernorm.weight"),
    ("layers.{layer}.ffn_norm.weight", "model.layers.{layer}.post_attention_layernorm.weight"),
    ("layers.{layer}.hc_attn_fn", "model.layers.{layer}.attn_hc.fn"),
    ("layers.{layer}.hc_attn_base", "model.layers.{layer}.attn_hc.base"),
    ("layers.{layer}.hc_attn_scale", "model.layers.{layer}.attn_hc.scale"),
    ("layers.{layer}.hc_ffn_fn", "model.layers.{layer}.ffn_hc.fn"),
    ("layers.{layer}.hc_ffn_base", "model.layers.{layer}.ffn_hc.base"),
    ("layers.{layer}.hc_ffn_scale", "model.layers.{layer}.ffn_hc.scale"),
    ("layers.{layer}.attn.wq_a.weight", "model.layers.{layer}.self_attn.q_a_proj.weight"),
    ("layers.{layer}.attn.q_norm.weight", "model.layers.{layer}.self_attn.q_a_norm.weight"),
    ("layers.{layer}.attn.wq_b.weight", "model.layers.{layer}.self_attn.q_b_proj.weight"),
    ("layers.{layer}.attn.wkv.weight", "model.layers.{layer}.self_attn.kv_proj.weight"),
    ("layers.{layer}.attn.norm.weight", "model.layers.{layer}.self_attn.kv_norm.weight"),
    ("layers.{layer}.attn.wo_a.weight", "model.layers.{layer}.self_attn.o_a_proj.weight"),
    ("layers.{layer}.attn.wo_b.weight", "model.layers.{layer}.self_attn.o_b_proj.weight"),
    ("layers.{layer}.attn.attn_sink", "model.layers.{layer}.self_attn.sinks"),
    ("layers.{layer}.attn.compressor.wkv.weight", "model.layers.{layer}.self_attn.compressor.kv_proj.weight"),
    ("layers.{layer}.attn.compressor.wgate.weight", "model.layers.{layer}.self_attn.compressor.gate_proj.weight"),
    ("layers.{layer}.attn.compressor.ape", "model.layers.{layer}.self_attn.compressor.position_bias"),
    ("layers.{layer}.attn.compressor.norm.weight", "model.layers.{layer}.self_attn.compressor.kv_norm.weight"),
    ("layers.{layer}.attn.indexer.wq_b.weight", "model.layers.{layer}.self_attn.indexer.q_b_proj.weight"),
    ("layers.{layer}.attn.indexer.weights_proj.weight", "model.layers.{layer}.self_attn.indexer.weights_proj.weight"),
    (
        "layers.{layer}.attn.indexer.compressor.wkv.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.kv_proj.weight",
    ),
    (
        "layers.{layer}.attn.indexer.compressor.wgate.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.gate_proj.weight",
    ),
    ("layers.{layer}.attn.indexer.compressor.ape", "model.layers.{layer}.self_attn.indexer.compressor.position_bias"),
    (
        "layers.{layer}.attn.indexer.compressor.norm.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.kv_norm.weight",
    ),
    ("layers.{layer}.ffn.gate.weight", "model.layers.{layer}.mlp.gate.weight"),
    ("layers.{layer}.ffn.gate.bias", "model.layers.{layer}.mlp.gate.e_score_correction_bias"),
    ("layers.{layer}.ffn.gate.tid2eid", "model.layers.{layer}.mlp.gate.tid2eid"),
    ("layers.{layer}.ffn.shared_experts.w1.weight", "model.layers.{layer}.mlp.shared_experts.gate_proj.weight"),
    ("layers.{layer}.ffn.shared_experts.w3.weight", "model.layers.{layer}.mlp.shared_experts.up_proj.weight"),
    ("layers.{layer}.ffn.shared_experts.w2.weight", "model.layers.{layer}.mlp.shared_experts.down_proj.weight"),
    ("layers.{layer}.ffn.experts.{expert}.w1.weight", "model.layers.{layer}.mlp.experts.gate_up_proj#{expert}.gate"),
    ("layers.{layer}.ffn.experts.{expert}.w3.weight", "model.layers.{layer}.mlp.experts.gate_up_proj#{expert}.up"),
    ("layers.{layer}.ffn.experts.{expert}.w2.weight", "model.layers.{layer}.mlp.experts.down_proj#{expert}.down"),
)

# transformers' module names where they differ from ours (its indexer hangs under the compressor).
TRANSFORMERS_NAMES: tuple[tuple[str, str], ...] = (
    (
        "model.layers.{layer}.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "model.layers.{layer}.self_attn.indexer.weights_proj.weight",
    ),
    (
        "model.layers.{layer}.self_attn.compressor.indexer.q_b_proj.weight",
        "model.layers.{layer}.self_attn.indexer.q_b_proj.weight",
    ),
    (
        "model.layers.{layer}.self_attn.compressor.indexer.kv_proj.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.kv_proj.weight",
    ),
    (
        "model.layers.{layer}.self_attn.compressor.indexer.gate_proj.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.gate_proj.weight",
    ),
    (
        "model.layers.{layer}.self_attn.compressor.indexer.position_bias",
        "model.layers.{layer}.self_attn.indexer.compressor.position_bias",
    ),
    (
        "model.layers.{layer}.self_attn.compressor.indexer.kv_norm.weight",
        "model.layers.{layer}.self_attn.indexer.compressor.kv_norm.weight",
    ),
)


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(f"^{escaped}$")


_FORWARD = [(_pattern(source), target) for source, target in NAMES + TRANSFORMERS_NAMES]
_BACKWARD = [(_pattern(ours), deepseek) for deepseek, ours in NAMES]


def _translate(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.format(**match.groupdict())
    return None


def parameter_name(checkpoint_name: str) -> tuple[str, int | None, str | None]:
    """Our parameter for a checkpoint tensor: ``(name, expert, part)``; part is ``"gate"``/``"up"``/``"down"``
    for one expert's slice of the stacked expert tensors. A name we do not know comes back unchanged."""
    name = _translate(checkpoint_name, _FORWARD)
    if name is None and checkpoint_name.startswith("model."):
        name = _translate(checkpoint_name[len("model.") :], _FORWARD)
    name = name or checkpoint_name
    if "#" not in name:
        return name, None, None
    stacked, _, slice_name = name.partition("#")
    expert, _, part = slice_name.partition(".")
    return stacked, int(expert), part


def checkpoint_name(parameter: str, expert: int | None = None, part: str | None = None) -> str:
    """DeepSeek's release name of our ``parameter`` (one ``expert``'s ``part`` of a stacked expert tensor)."""
    key = parameter if expert is None else f"{parameter}#{expert}.{part}"
    name = _translate(key, _BACKWARD)
    if name is None:
        raise KeyError(f"DeepSeek V4 parameter {key!r} has no checkpoint name in weft_dsv4.weights.NAMES")
    return name
