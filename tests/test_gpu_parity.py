"""Weft on an NVIDIA GPU against Hugging Face transformers with identical weights.

* Tiny random Llama and Qwen3 checkpoints in float32: greedy tokens equal HF ``generate()``
  (CUDA graphs and the Triton backend on, the defaults).
* Llama-3-8B's and Qwen3-0.6B's shapes with random bf16 weights: the logits of the prompt's forward and of
  64 teacher-forced decode steps. Tolerance: bf16 rounding makes any bf16 run differ from
  exact arithmetic; the test measures how far HF's own bf16 run is from an fp32 run of the
  same weights, and requires Weft's bf16 run to be no further than 1.5 times that
  (mean relative L2 error over positions; worst position within 2 times).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from test_hf_parity import NEW_TOKENS, hf_greedy, prompts_of_lengths
from weft import LLM, SamplingParams
from weft.runner.sampler import SAMPLED, SampledBatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral-window"])
def test_tiny_models_match_hf_greedy_on_gpu(kind, tmp_path, tokenizer_files):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / kind, kind, tokenizer_files)
    prompts = prompts_of_lengths([1, 3, 7, 16, 17, 40, 90, 150])
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    reference = hf_greedy(hf, prompts)
    llm = LLM(
        model=str(folder),
        use={"platform": "cuda"},
        engine={"dtype": "float32", "max_num_batched_tokens": 96, "block_size": 16, "num_kv_blocks": 512},
    )
    assert llm.engine.runner.graphs and llm.engine.worker.attention.name == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, expected, output in zip(prompts, reference, outputs, strict=False):
        assert output.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"


class TeacherSampler:
    """Stands in for the sampler: records each step's logits and returns the forced next token."""

    def __init__(self, forced: list[int]) -> None:
        self.forced, self.logits = forced, []

    def sample(self, logits, requests, counts=None):
        self.logits.append(logits[0].float().cpu())
        step = len(self.logits) - 1
        token = self.forced[step] if step < len(self.forced) else 0
        return SampledBatch(torch.tensor([token], device=logits.device), torch.tensor([SAMPLED], device=logits.device))


def hf_teacher_forced(model, prompt: list[int], forced: list[int]) -> list[torch.Tensor]:
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
        logits = [out.logits[0, -1].float().cpu()]
        cache = out.past_key_values
        for token in forced:
            out = model(torch.tensor([[token]], device="cuda"), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float().cpu())
    return logits


def relative_errors(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(a - b).norm() / b.norm() for a, b in zip(logits, reference, strict=False)])


@pytest.mark.parametrize("shape", ["llama3-8b", "qwen3-0.6b"])
def test_bf16_logits_of_real_shapes_agree_with_hf(shape, tokenizer_files):
    """Llama-3-8B's shape, and Qwen3-0.6B's, whose q/k norms and rotation run as one fused op in bf16."""
    from transformers import AutoModelForCausalLM

    from gpu_common import SHAPES, MemoryLoader, hf_config, registry_with_memory_loader

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config(SHAPES[shape]), dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(10, 120000, (300,), generator=generator).tolist()
    forced = torch.randint(10, 120000, (64,), generator=generator).tolist()
    hf_bf16 = hf_teacher_forced(hf, prompt, forced)
    hf32 = copy.deepcopy(hf).float()
    exact = hf_teacher_forced(hf32, prompt, forced)
    del hf32
    torch.cuda.empty_cache()

    state = hf.state_dict()
    model = MemoryLoader.add(f"{shape}-parity", SHAPES[shape], lambda: iter(state.items()), tokenizer_files)
    llm = LLM(
        model=model,
        registry=registry_with_memory_loader(),
        use={"platform": "cuda"},
        engine={"dtype": "bfloat16", "num_kv_blocks": 256, "max_model_len": 1024, "max_num_seqs": 8},
    )
    if shape == "qwen3-0.6b":
        assert type(llm.engine.worker.ops["qk_norm_rotary"]).__name__ == "QkNormRotaryTriton"
        assert llm.engine.runner.model.model.layers[0].self_attn.qk_norm_rotary is not None
    teacher = TeacherSampler(forced)
    llm.engine.runner.sampler = teacher
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(forced) + 1, ignore_eos=True))
    assert len(teacher.logits) == len(forced) + 1

    hf_error = relative_errors(hf_bf16, exact)
    weft_error = relative_errors(teacher.logits, exact)
    agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(teacher.logits, exact, strict=False))
    print(
        f"\nrelative L2 error vs fp32 HF: HF bf16 mean {hf_error.mean():.4f} max {hf_error.max():.4f}; "
        f"Weft bf16 mean {weft_error.mean():.4f} max {weft_error.max():.4f}; "
        f"Weft argmax equals fp32 argmax at {agree}/{len(exact)} positions"
    )
    assert weft_error.mean() <= 1.5 * hf_error.mean()
    assert weft_error.max() <= 2 * hf_error.max()
