"""Loading the Llama-3-8B shape (bf16, 16 GB, 4 shards on local disk) on one GPU.

* ``--part fastsafetensors``: ``Worker.load_model`` (model built on the GPU, weights read and copied
  in) with the ``fastsafetensors`` loader against the plain ``safetensors`` loader, page cache
  dropped before each (cold) and not (warm).
* ``--part weight-cache``: an engine start (``LLM(...)`` until ready) with the ``weight-cache`` loader
  and its daemon warm, against a cold start from disk; both generate the same 16 greedy tokens.

Cold figures need root to drop the page cache (``/proc/sys/vm/drop_caches``); without it they are
printed as warm. The checkpoint is written once to ``--dir`` (random weights made on the GPU).

Usage: python bench/gpu_loading.py --tokenizer DIR [--dir /tmp/weft-llama8b] --part fastsafetensors --part weight-cache
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import LLAMA3_8B, hf_parameter_shapes  # noqa: E402

SHARDS = 4
PROMPT = [128000, 791, 6460, 374, 264, 2294, 1990, 315, 279, 1917, 11, 323, 433, 374]


def write_checkpoint(folder: Path, tokenizer: Path) -> Path:
    from safetensors.torch import save_file

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    shapes = hf_parameter_shapes(LLAMA3_8B)
    generator = torch.Generator(device="cuda").manual_seed(0)
    per_shard = -(-len(shapes) // SHARDS)
    weight_map = {}
    for shard in range(SHARDS):
        name = f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {}
        for tensor_name, shape in shapes[shard * per_shard : (shard + 1) * per_shard]:
            if len(shape) == 1:
                tensors[tensor_name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[tensor_name] = (
                    (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(torch.bfloat16).cpu()
                )
            weight_map[tensor_name] = name
        save_file(tensors, folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B | {"torch_dtype": "bfloat16"}))
    for file in tokenizer.iterdir():
        shutil.copy(file, folder / file.name)
    os.sync()
    return folder


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def load_model_seconds(folder: Path, loader: str, cold: bool, socket_dir: Path | None = None) -> tuple[float, str]:
    from weft.config import load_config
    from weft.plugins import PluginRegistry
    from weft.resolve import resolve_engine_config
    from weft.runner.worker import Worker

    registry = PluginRegistry()
    overrides: dict = {"model": str(folder), "use": {"loader": loader}}
    if socket_dir is not None:
        overrides["plugins"] = {"weight-cache": {"socket_dir": str(socket_dir)}}
    config = resolve_engine_config(load_config(None, overrides), registry)
    dropped = drop_page_cache() if cold else False
    worker = Worker(config, registry)
    torch.cuda.synchronize()
    start = time.perf_counter()
    worker.load_model()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del worker
    gc.collect()  # the model and its engine hold reference cycles: free them before the next measurement
    torch.cuda.empty_cache()
    return seconds, "cold" if dropped else "warm"


def part_fastsafetensors(folder: Path) -> None:
    size = sum(file.stat().st_size for file in folder.glob("*.safetensors"))
    print(f"## Worker.load_model, Llama-3-8B shape ({size / 1e9:.1f} GB bf16, {SHARDS} shards)", flush=True)
    for cold in (True, False):
        plain, state = load_model_seconds(folder, "safetensors", cold)
        fast, _ = load_model_seconds(folder, "fastsafetensors", cold)
        print(
            f"{state}: safetensors {plain:.2f} s ({size / plain / 1e9:.1f} GB/s), fastsafetensors {fast:.2f} s "
            f"({size / fast / 1e9:.1f} GB/s): fastsafetensors/plain time = {fast / plain:.2f}",
            flush=True,
        )


def engine_start(folder: Path, loader: str, socket_dir: Path) -> tuple[float, list[int]]:
    from weft import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=str(folder),
        use={"loader": loader},
        engine={"gpu_memory_utilization": 0.5, "max_model_len": 4096},
        plugins={"weight-cache": {"socket_dir": str(socket_dir)}},
    )
    seconds = time.perf_counter() - start
    tokens = (
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    )
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return seconds, list(tokens)


def part_weight_cache(folder: Path) -> None:
    socket_dir = Path(f"/tmp/weft-bench-wc-{os.getpid()}")
    dropped = drop_page_cache()
    cold, tokens = engine_start(folder, "safetensors", socket_dir)
    start = time.perf_counter()
    daemon_log = socket_dir.with_suffix(".log")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "weft.cli", "weights", "serve", "--model", str(folder), "--socket-dir", str(socket_dir)],
        stdout=subprocess.PIPE,
        stderr=daemon_log.open("w"),
        text=True,
    )
    line = daemon.stdout.readline()
    daemon_seconds = time.perf_counter() - start
    try:
        if not line.startswith("weft weights: serving"):
            raise SystemExit(f"the daemon did not start: {line}")
        drop_page_cache()
        warm, cached_tokens = engine_start(folder, "weight-cache", socket_dir)
        load_warm = load_model_seconds(folder, "weight-cache", cold=True, socket_dir=socket_dir)[0]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
    load_cold = load_model_seconds(folder, "safetensors", cold=True)[0]
    print(
        f"## Engine start (LLM(...) until ready), Llama-3-8B shape; daemon start (load + pin) {daemon_seconds:.1f} s",
        flush=True,
    )
    print(
        f"{'cold' if dropped else 'warm'} disk: {cold:.2f} s; weight-cache daemon warm: {warm:.2f} s: "
        f"warm/cold = {warm / cold:.2f}",
        flush=True,
    )
    print(
        f"Worker.load_model alone: disk {load_cold:.2f} s, weight cache {load_warm:.2f} s: ratio "
        f"{load_warm / load_cold:.2f}",
        flush=True,
    )
    leases = daemon_log.read_text().count("weight cache: lease ")
    print(
        f"same 16 greedy tokens: {tokens == cached_tokens}; leases the daemon granted: {leases} (2 expected: the "
        f"engine and the timed load)",
        flush=True,
    )
    if leases < 2:
        raise SystemExit(f"the engines did not map the daemon's weights (leases: {leases}); see {daemon_log}")
    if tokens != cached_tokens:
        raise SystemExit(f"the weight cache changed the output: {tokens} against {cached_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/weft-llama8b"))
    parser.add_argument("--part", action="append", choices=["fastsafetensors", "weight-cache"], required=True)
    args = parser.parse_args()
    print(f"# gpu_loading: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    folder = write_checkpoint(args.dir, args.tokenizer)
    for part in args.part:
        {"fastsafetensors": part_fastsafetensors, "weight-cache": part_weight_cache}[part](folder)


if __name__ == "__main__":
    main()
