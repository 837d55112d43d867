"""The families beyond Llama (Gemma 2/3, Phi-3/4, DeepSeek V3) equal transformers on tiny random checkpoints.

Each checkpoint is made here with transformers (every parameter random, norms included, so a norm applied
as ``weight`` rather than ``1 + weight`` shows), its sliding windows shorter than the longer prompts. Greedy
output through the engine (small blocks and step budget: chunked prefill, many blocks per request) must equal
HF ``generate``; ``weft verify`` must pass in float32 and bfloat16, with logits within the dtype's band.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from test_hf_parity import hf_greedy, prompts_of_lengths
from weft import LLM, SamplingParams
from weft.verify import noise_ceiling, verify

NEW_TOKENS = 12
PROMPT_LENGTHS = [3, 21, 70]
"""Shorter and longer than the sliding windows (16), and a prompt chunked over several steps."""

SIZES = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    "gemma2": dict(
        model_type="gemma2",
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=24,
        sliding_window_pattern=2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 20000.0},
        },
        tie_word_embeddings=False,
    ),
    # Phi-4-mini's shape: LongRoPE (the long factors from 25 tokens on), a rotation of 3/4 of each head.
    "phi3": dict(
        model_type="phi3",
        head_dim=16,
        sliding_window=16,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=24,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.2 * i for i in range(6)],
            "long_factor": [2.0 + 0.7 * i for i in range(6)],
        },
    ),
    # MLA with both query paths' rope interleaved, yarn with mscale; a dense first layer, then MoE layers
    # (8 experts in 4 groups, 2 groups chosen, 2 experts a token, one shared expert).
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
}

PROMPT_LENGTHS_OF = {"phi3": [3, 9, 40, 70]}
"""Phi-3: requests within the original context to the end and requests beyond it from their first step."""


def make_checkpoint(folder: Path, family: str, tokenizer_folder: Path, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**SIZES, **FAMILIES[family], **overrides}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, saved: the choice it shifts must be read
                buffer.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    for file in tokenizer_folder.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory, tokenizer_files, one_torch_thread):
    return request.param, make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tokenizer_files)


def test_greedy_output_matches_hf(checkpoint):
    from transformers import AutoModelForCausalLM

    family, checkpoint = checkpoint
    prompts = prompts_of_lengths(PROMPT_LENGTHS_OF.get(family, PROMPT_LENGTHS))
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    reference = hf_greedy(hf, prompts, NEW_TOKENS)
    llm = LLM(model=str(checkpoint), engine={"max_num_batched_tokens": 32, "block_size": 8, "num_kv_blocks": 128})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, expected, output in zip(prompts, reference, outputs, strict=False):
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weft_verify_passes_with_logits_in_the_dtypes_band(checkpoint, dtype):
    """Greedy tokens match (or part at a near-tie), and teacher-forced log-probs differ from the reference's by
    no more than rounding (``weft verify``'s noise ceiling: a defect such as a wrong attention scale exceeds it)."""
    family, checkpoint = checkpoint
    prompts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n" * 2]
    if family == "phi3":  # a sequence crossing the original context keeps keys cached before it (the module says)
        prompts = ["The capital of France is", "def fibonacci(n):"]
    report = verify(str(checkpoint), prompts, dtype=dtype, max_tokens=6)
    assert report.passed, report.table()
    assert report.teacher_forced_error <= noise_ceiling(report.reference_noise, dtype), report.table()


PARALLEL_LAYOUTS = {
    "gemma2": [{"tensor_parallel_size": 2}],
    "phi3": [{"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
    "deepseek_v3": [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}],
}


@pytest.mark.parametrize("checkpoint", list(PARALLEL_LAYOUTS), indirect=True)
def test_a_parallel_layout_gives_the_greedy_tokens_of_one_device(checkpoint):
    """The families shard over gloo worker processes: Gemma over two tensor ranks (Gemma 3 shares Gemma 2's
    module), Phi-3 over two tensor ranks in each of two pipeline stages, DeepSeek V3 over two tensor ranks (its
    heads and every expert's columns split) and with expert parallelism (4 of the 8 routed experts a rank)."""
    family, checkpoint = checkpoint
    engine = {"max_num_batched_tokens": 32, "block_size": 8, "num_kv_blocks": 64}
    prompts = prompts_of_lengths([5, 40, 17])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for parallel in [{}, *PARALLEL_LAYOUTS[family]]:
        llm = LLM(model=str(checkpoint), engine={**engine, **parallel})
        try:
            outputs.append([output.outputs[0].token_ids for output in llm.generate(prompts, params)])
        finally:
            llm.engine.close()
    for layout, output in zip(PARALLEL_LAYOUTS[family], outputs[1:], strict=True):
        assert output == outputs[0], layout


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
def test_deepseek_v3_refuses_a_layout_it_cannot_split(checkpoint):
    """Before any worker starts: pipeline stages, or heads the ranks do not divide."""
    folder, engine = str(checkpoint[1]), {"block_size": 8, "num_kv_blocks": 64}
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM runs one pipeline stage"):
        LLM(model=folder, engine={**engine, "pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 3 does not divide the model's 4 attention heads"):
        LLM(model=folder, engine={**engine, "tensor_parallel_size": 3})


def test_older_gemma3_and_phi3_configs_read_as_transformers_reads_them():
    """Hub configs from before transformers 5 (Gemma 3's ``rope_local_base_freq`` and ``sliding_window_pattern``,
    Phi-3.5's ``rope_scaling`` with ``type`` and a top-level ``original_max_position_embeddings``) mean what
    transformers makes of them."""
    from transformers import AutoConfig

    from weft.models.gemma import GemmaSettings
    from weft.models.phi3 import Phi3Settings

    gemma3 = dict(
        SIZES,
        model_type="gemma3_text",
        num_hidden_layers=7,
        head_dim=32,
        sliding_window=16,
        rope_theta=50000.0,
        rope_local_base_freq=500.0,
        sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    hf = AutoConfig.for_model(**gemma3)
    settings = GemmaSettings({key: value for key, value in gemma3.items() if key != "model_type"}, "Gemma3ForCausalLM")
    assert settings.layer_types == hf.layer_types
    assert settings.sliding_windows == [16 if kind == "sliding_attention" else None for kind in hf.layer_types]
    for kind in ("sliding_attention", "full_attention"):
        assert {key: settings.ropes[kind].get(key) for key in ("rope_type", "rope_theta", "factor")} == {
            key: hf.rope_parameters[kind].get(key) for key in ("rope_type", "rope_theta", "factor")
        }

    factors = dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    phi3 = dict(SIZES, original_max_position_embeddings=128, rope_scaling={"type": "longrope", **factors})
    hf = AutoConfig.for_model("phi3", **phi3)
    rope = Phi3Settings(phi3, "Phi3ForCausalLM").rope
    assert rope["rope_type"] == hf.rope_parameters["rope_type"] == "longrope"
    assert rope["original_max_position_embeddings"] == hf.rope_parameters["original_max_position_embeddings"] == 128
