"""Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss) equal transformers on tiny random checkpoints:
greedy output through the engine and the logits of one forward, prompts longer than the sliding windows."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from test_hf_parity import hf_greedy, prompts_of_lengths
from weft import LLM, SamplingParams

MOE_CONFIGS = {
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
    ),
    "qwen3_moe-unnormalised": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=1,
        moe_intermediate_size=48,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=24,
    ),
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        sliding_window=12,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    ),
}


def make_moe_model(folder: Path, kind: str, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of ``kind`` (:data:`MOE_CONFIGS`) saved as safetensors, with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MOE_CONFIGS[kind])
    model_type = spec.pop("model_type")
    defaults = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = AutoConfig.for_model(model_type, **{**defaults, **spec})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy paths and routing are not flat
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
            elif name.endswith(("bias", "sinks")):  # gpt-oss's biases start at zero: make them matter
                parameter.normal_(0, 1.0 if name.endswith("sinks") else 0.2)
    model.save_pretrained(str(folder))
    for file in tokenizer_folder.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_moe_families_match_hf_greedy(kind, tmp_path, tokenizer_files):
    from transformers import AutoModelForCausalLM

    folder = make_moe_model(tmp_path / kind, kind, tokenizer_files)
    prompts = prompts_of_lengths([1, 7, 17, 40, 90])
    reference = hf_greedy(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(), prompts, 24)
    llm = LLM(model=str(folder), engine={"max_num_batched_tokens": 64, "block_size": 8, "num_kv_blocks": 256})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, expected, output in zip(prompts, reference, outputs, strict=False):
        assert output.outputs[0].token_ids == expected, f"{kind}: prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_weft_verify_passes_with_logits_equal_to_transformers(kind, tmp_path, tokenizer_files, capsys):
    """``weft verify``: greedy tokens equal and every teacher-forced log-probability within fp32 rounding."""
    from weft.cli import main

    folder = make_moe_model(tmp_path / kind, kind, tokenizer_files)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n" + "Once upon a time, in a small village by the sea, " * 3 + "\n")
    code = main(["verify", str(folder), "--prompts", str(prompts), "--max-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2/2 prompts matched" in out, out
    assert float(re.search(r"max teacher-forced error (\S+)", out).group(1)) < 1e-4, out


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path, tokenizer_files):
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales, as published, equals transformers on the
    same experts dequantized by transformers' own converter (``convert_moe_packed_tensors``)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = make_moe_model(tmp_path / "dense", "gpt_oss", tokenizer_files)
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors[name].shape  # transformers' layout: [E, in, out]
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(122, 128, (experts, outer, inner // 32), generator=generator, dtype=torch.uint8)
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dequantized[name].shape == tensors[name].shape
    save_file(dequantized, str(folder / "model.safetensors"), metadata={"format": "pt"})
    mxfp4 = tmp_path / "mxfp4"
    shutil.copytree(folder, mxfp4)
    save_file(quantized, str(mxfp4 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mxfp4 / "config.json").write_text(json.dumps(config))

    prompts = prompts_of_lengths([5, 30])
    reference = hf_greedy(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval(), prompts, 16)
    llm = LLM(model=str(mxfp4), engine={"block_size": 8, "num_kv_blocks": 64})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [output.outputs[0].token_ids for output in outputs] == reference


def test_a_backend_without_sinks_refuses_a_layer_with_them():
    from weft.builtins.torch_attention import TorchAttention
    from weft.contracts.attention import AttentionLayer

    layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25, sliding_window=8, sinks=True)
    TorchAttention(None, None).check_layer(layer)

    class NoSinks(TorchAttention):
        name = "no-sinks"
        supports_sinks = False

    with pytest.raises(ValueError, match=r"'no-sinks' does not support attention sinks .*the 'torch' backend does"):
        NoSinks(None, None).check_layer(layer)
