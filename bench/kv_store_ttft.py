"""Time to first token with and without MooncakeStore hits for a shared prefix, in one run, and the load bandwidth.

A real ``mooncake_master`` and a ``mooncake_client`` storage node on loopback (weft_mooncake.local).
A connector engine computes the prefix once and saves it. Then, alternating, each round measures:

  * baseline: an engine without a connector computes prefix + a fresh 16-token tail;
  * store hit: an engine with the connector loads the prefix from the store and computes the tail;
  * store miss: the connector engine gets a prompt whose prefix is not stored: it computes it, and
    saves it in the background (the saves are waited for before the next measurement).

``--variants`` measures several connector engines in one run (each against the same baseline engine,
with a prefix of its own, which it computes and saves first): ``async`` (the default: the request waits
outside the batch until its load is over), ``sync`` (loaded before its step's forward) and ``sync:N``
(objects of N layers each: the load lands layer by layer while the forward runs).
Both measuring engines run with ``enable_prefix_caching = false``, so that every request of
the connector engine goes to the store instead of the engine's own prefix cache. TTFT is the
wall time of ``generate(max_tokens=1)``. Medians of the rounds, with the ratios to the baseline.
The load bandwidth is the bytes the hits loaded over the seconds their loads took (the connector's
``loaded_bytes_total`` and ``load_seconds`` metrics: store reads and, on a GPU, the staging copies),
against a pinned host-to-device copy of the same size measured in the same run on a GPU.

* CPU (default): the default model (SmolLM2-135M-Instruct, float32), a 2k-token prefix.
* ``--gpu``: the Llama-3-8B shape with random bf16 weights (``random:llama3-8b``, bench/gpu_common.py)
  on the cuda platform, CUDA graphs on, a 4k-token prefix; the KV cache is on the GPU and moves
  through the connector's pinned staging buffer::

    python bench/kv_store_ttft.py [--prefix 2048] [--rounds 3]
    python bench/kv_store_ttft.py --gpu --tokenizer DIR [--prefix 4096] [--rounds 5] [--variants async,sync,sync:8]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch


def ttft(llm, prompt: list[int]) -> float:
    from weft import SamplingParams

    start = time.perf_counter()
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(output[0].outputs[0].token_ids) == 1
    return elapsed


def settle(llm) -> None:
    """Wait until the connector's background saves are done, so that they do not overlap the next measurement."""
    llm.engine.core.wait_for_saves(timeout=600)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def pinned_copy_bandwidth(size: int) -> float:
    """Bytes per second of one pinned host-to-device copy of ``size`` bytes (best of five)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return size / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the Llama-3-8B shape on the GPU (needs --tokenizer)")
    parser.add_argument("--tokenizer", type=Path, help="folder of SmolLM2's tokenizer files, for --gpu")
    parser.add_argument("--prefix", type=int, help="shared prefix tokens (default: 2048; 4096 with --gpu)")
    parser.add_argument("--tail", type=int, default=16, help="tokens after the prefix, fresh in every request")
    parser.add_argument("--rounds", type=int, help="default: 3; 5 with --gpu")
    parser.add_argument("--staging-mib", type=int, help="the connector's staging_buffer_size in MiB (default: its own)")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=parse_variants("async"),
        help="connector engines to measure, comma-separated: async, sync, sync:N (synchronous loads of "
        "objects of N layers each, landing layer by layer); default: async",
    )
    args = parser.parse_args()
    prefix = args.prefix or (4096 if args.gpu else 2048)
    rounds = args.rounds or (5 if args.gpu else 3)
    variants = args.variants

    from weft import LLM
    from weft_mooncake.local import LocalMooncake

    if args.gpu:
        if args.tokenizer is None:
            parser.error("--gpu needs --tokenizer (a folder of SmolLM2's tokenizer files)")
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_common import install_random_loader

        os.environ["WEFT_TEST_TOKENIZER"] = str(args.tokenizer.resolve())
        install_random_loader(Path(tempfile.mkdtemp(prefix="weft-bench-site-")))
        blocks = 2 * (prefix + args.tail) // 16 + 64  # room for one request and its warm-up
        model, vocab = "random:llama3-8b", 120000
        engine = {
            "enable_prefix_caching": False,
            "dtype": "bfloat16",
            "num_kv_blocks": blocks,
            "max_model_len": prefix + args.tail + 64,
        }
        use: dict[str, str] = {"platform": "cuda"}
        machine = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
        segment = (rounds + 2 * len(variants) + 3) * (prefix // 16) * (2 << 20)  # every prefix stored (2 MiB a block)
    else:
        model, vocab = None, 40000
        engine = {"enable_prefix_caching": False, "dtype": "float32"}
        use = {}
        machine = (
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}"
        )
        segment = 1 << 30
    print(f"# kv_store_ttft: {machine}, {time.strftime('%Y-%m-%d')}", flush=True)
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(100, vocab, (count,), generator=generator).tolist()

    plain = {"model": model, "engine": engine, "use": use} if model else {"engine": engine, "use": use}
    with LocalMooncake(segment_size=segment) as store:
        staging = {"staging_buffer_size": args.staging_mib << 20} if args.staging_mib else {}

        def connector(variant: Variant) -> dict:
            options = store.options(**staging, load_async=variant.load_async, layers_per_object=variant.layers)
            return {**plain, "use": {**use, "kv_connector": "mooncake"}, "plugins": {"mooncake": options}}

        baseline_engine = LLM(**plain)
        ttft(baseline_engine, tokens(32))  # warm-up
        runs: dict[str, list[float]] = {"baseline": []}
        loads: dict[str, list[tuple[float, float]]] = {}
        for index, variant in enumerate(variants):
            shared = tokens(prefix)  # a prefix of its own: each variant's key layout
            with LLM(**connector(variant)) as reader:
                ttft(reader, tokens(32))  # warm-up
                seconds = ttft(reader, shared + tokens(args.tail))  # computes and saves the prefix
                settle(reader)
                print(f"[{variant.name}] computed and saved the {prefix}-token prefix: {seconds:.2f} s", flush=True)
                runs[variant.name], loads[variant.name] = [], []
                if index == 0:
                    runs["miss"] = []
                for _ in range(rounds):
                    runs["baseline"].append(ttft(baseline_engine, shared + tokens(args.tail)))
                    totals = reader.engine.kv_connector.metric_totals
                    before = {name: total.total for name, total in totals.items()}
                    runs[variant.name].append(ttft(reader, shared + tokens(args.tail)))
                    loads[variant.name].append(
                        tuple(
                            totals[name].total - before.get(name, 0.0)
                            for name in ("loaded_bytes_total", "load_seconds")
                        )
                    )
                    if index == 0:
                        runs["miss"].append(ttft(reader, tokens(prefix + args.tail)))
                        settle(reader)
                stats = reader.engine.kv_connector.stats
            assert stats.hit_tokens == rounds * prefix and stats.failed_load_tokens == 0, (variant, stats)
        baseline_engine.close()

    baseline = median(runs["baseline"])
    print(
        f"prompt {prefix} + {args.tail} tokens, medians of {rounds} rounds per variant "
        f"(all: {', '.join(f'{name} ' + '/'.join(f'{v:.3f}' for v in values) for name, values in runs.items())})"
    )
    print(f"TTFT without connector      {baseline:8.3f} s   (baseline: computes {prefix + args.tail} tokens)")
    ceiling = None
    for variant in variants:
        hit = median(runs[variant.name])
        print(
            f"TTFT with store hit, {variant.name:<10} {hit:8.3f} s   speed-up {baseline / hit:5.2f}x "
            f"(baseline / hit: above 1 is faster; {variant.describe()})"
        )
        loaded, seconds = sorted(loads[variant.name], key=lambda load: load[1])[len(loads[variant.name]) // 2]
        rate = loaded / seconds
        line = (
            f"  load of a hit: {loaded / 2**20:.0f} MiB in {seconds * 1e3:.1f} ms = {rate / 1e9:.2f} GB/s "
            f"(median of {rounds})"
        )
        if args.gpu:
            ceiling = ceiling or pinned_copy_bandwidth(int(loaded))
            line += (
                f"; a pinned host-to-device copy of the same size {ceiling / 1e9:.2f} GB/s: ratio {rate / ceiling:.2f}"
            )
        print(line)
    print(
        f"TTFT with store miss        {median(runs['miss']):8.3f} s   ratio {median(runs['miss']) / baseline:5.2f}x "
        f"the baseline ({variants[0].name})"
    )


class Variant(NamedTuple):
    """A connector engine's loads: asynchronous or synchronous, and layers per stored object (0: all)."""

    load_async: bool
    layers: int

    @property
    def name(self) -> str:
        return ("async" if self.load_async else "sync") + (f":{self.layers}" if self.layers else "")

    def describe(self) -> str:
        mode = "loaded in the background, then scheduled" if self.load_async else "loaded before and during its step"
        return mode + (f", objects of {self.layers} layers" if self.layers else ", objects of every layer")


def parse_variants(text: str) -> list[Variant]:
    """``async``, ``sync`` or ``sync:N`` (N layers per object), comma-separated."""
    variants = []
    for item in text.split(","):
        mode, _, layers = item.strip().partition(":")
        if mode not in ("async", "sync") or (layers and not layers.isdigit()):
            raise argparse.ArgumentTypeError(
                f"--variants item {item!r}: write async, sync or sync:N (N layers per object)"
            )
        variants.append(Variant(mode == "async", int(layers or 0)))
    return variants


if __name__ == "__main__":
    main()
