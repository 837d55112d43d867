"""Time to first token with and without MooncakeStore hits, for a 2k-token shared prefix, in one run.

On the default model (SmolLM2-135M-Instruct, float32), a real ``mooncake_master`` and a
``mooncake_client`` storage node on loopback (weft_mooncake.local). A first engine
computes the 2,048-token prefix once and saves it. Then, alternating, each of three rounds measures:

  * baseline: an engine without a connector computes prefix + a fresh 16-token tail;
  * store hit: an engine with the connector loads the prefix from the store and computes the tail;
  * store miss: the connector engine gets a prompt whose prefix is not stored: it computes it, and
    saves it in the background (the saves are waited for before the next measurement).

Both measuring engines run with ``enable_prefix_caching = false``, so that every request of
the connector engine goes to the store instead of the engine's own prefix cache. TTFT is the
wall time of ``generate(max_tokens=1)``. Medians of the rounds, with the ratios to the baseline::

    python bench/kv_store_ttft.py [--prefix 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--tail", type=int, default=16, help="tokens after the prefix, fresh in every request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from weft import LLM
    from weft_mooncake.local import LocalMooncake

    print(f"# kv_store_ttft: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}")
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(100, 40000, (count,), generator=generator).tolist()

    engine = {"enable_prefix_caching": False, "dtype": "float32"}
    with LocalMooncake(segment_size=1 << 30) as store:
        connector = {"use": {"kv_connector": "mooncake"}, "plugins": {"mooncake": store.options()}}
        shared = tokens(args.prefix)
        with LLM(engine=engine, **connector) as writer:
            seconds = ttft(writer, shared + tokens(args.tail))
        print(f"first engine computed and saved the {args.prefix}-token prefix: {seconds:.2f} s", flush=True)

        baseline_engine = LLM(engine=engine)
        with LLM(engine=engine, **connector) as reader:
            ttft(baseline_engine, tokens(32))  # warm-up of both engines
            ttft(reader, tokens(32))
            runs: dict[str, list[float]] = {"baseline": [], "hit": [], "miss": []}
            for _ in range(args.rounds):
                runs["baseline"].append(ttft(baseline_engine, shared + tokens(args.tail)))
                runs["hit"].append(ttft(reader, shared + tokens(args.tail)))
                runs["miss"].append(ttft(reader, tokens(args.prefix + args.tail)))
                settle(reader)
            stats = reader.engine.kv_connector.stats
        assert stats.hit_tokens == args.rounds * args.prefix and stats.failed_load_tokens == 0, stats

    baseline = median(runs["baseline"])
    print(f"prompt {args.prefix} + {args.tail} tokens, medians of {args.rounds} rounds "
          f"(all: {', '.join(f'{name} ' + '/'.join(f'{v:.2f}' for v in values) for name, values in runs.items())})")
    print(f"TTFT without connector      {baseline:6.2f} s   (baseline)")
    print(f"TTFT with store hit         {median(runs['hit']):6.2f} s   ratio {baseline / median(runs['hit']):5.1f}x faster")
    print(f"TTFT with store miss        {median(runs['miss']):6.2f} s   ratio {median(runs['miss']) / baseline:5.2f}x the baseline")


if __name__ == "__main__":
    main()
