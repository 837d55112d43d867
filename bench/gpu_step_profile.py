"""Where the wall time of an offline run goes, step by step (:mod:`weft.engine.core.step_profile`).

The workload runs twice in one engine with default settings: once unprofiled (the warm-up, and the
baseline the profiled run's wall is compared with: the profile's own overhead), then once with a
step profile set on the engine core. Printed, all as compact text:

* the wall split on the device timeline: device busy in steps, idle between them, and before the
  first and after the last, against the host's wall (their sum should match it);
* the host's side: scheduling before each launch, the launch calls, waiting for tokens, the rest of
  the core step, and everything outside it (output processing, the ``LLM.generate`` loop);
* per phase (decode steps replaying a graph, eager decode steps, mixed prefill and decode steps,
  pure prefill steps, idle steps): steps, device and idle time, tokens and tokens/s;
* the largest device-idle gaps, a histogram of decode batch sizes, and the first and last steps.

Workloads: ``--shape llama3-8b`` (default; 512 x (512 prompt, 256 output)), ``--shape qwen3-0.6b``
(256 x (512, 256)), random bf16 weights on the GPU; ``--tiny``: a random 2-layer Llama on the CPU,
32 x (64, 32), asynchronous scheduling on as on a GPU (a host-bound proxy to try the tool on).

Usage:
  python3 bench/gpu_step_profile.py --tokenizer .whl/tokenizer [--shape qwen3-0.6b] [--engine KEY=VALUE]
  python bench/gpu_step_profile.py --tiny
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from weft import LLM, SamplingParams
from weft.config import parse_override
from weft.engine.core.step_profile import StepProfile, StepRecord

PHASES = ("prefill", "mixed", "decode/graph", "decode/eager", "idle")
WORKLOADS = {"llama3-8b": (512, 512, 256), "qwen3-0.6b": (256, 512, 256), "tiny": (32, 64, 32)}
"""Requests, prompt and output tokens per request."""
TINY_ENGINE = {"async_scheduling": True, "max_num_seqs": 32, "max_num_batched_tokens": 256}
"""The CPU run's engine: a GPU's asynchronous scheduling, and a budget that chunks the prompts into mixed steps."""


def build(args: argparse.Namespace, scratch: Path) -> LLM:
    if args.tiny:
        from structured_output import tiny_model

        torch.set_num_threads(1)  # a forward this small gains nothing from threads
        return LLM(model=tiny_model(scratch), engine={**TINY_ENGINE, **args.engine})
    from gpu_common import SHAPES, MemoryLoader, random_weights, registry_with_memory_loader

    shape = SHAPES[args.shape]
    model = MemoryLoader.add(args.shape, shape, random_weights(shape, torch.bfloat16), args.tokenizer)
    return LLM(
        model=model,
        registry=registry_with_memory_loader(),
        use={"platform": "cuda"},
        engine={"dtype": "bfloat16", **args.engine},
    )


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (count, length), generator=generator).tolist()


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams, profile: StepProfile | None) -> float:
    """Seconds of one ``LLM.generate`` of every prompt, profiled when ``profile`` is given."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    core = llm.engine.core
    synchronize()
    if profile is not None:
        core.step_profile = profile
        profile.start()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    if profile is not None:
        profile.stop()
        core.step_profile = None
    synchronize()
    seconds = time.perf_counter() - started
    assert sum(len(output.outputs[0].token_ids) for output in outputs) == len(prompts) * params.max_tokens
    return seconds


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def share(part: float, whole: float) -> str:
    return f"{part / whole:6.1%}" if whole else "     -"


def print_wall(profile: StepProfile) -> None:
    worked = [record for record in profile.records if record.requests]
    head = worked[0].idle_before or 0.0 if worked else 0.0
    busy = sum(record.device or 0.0 for record in worked)
    idle = sum(record.idle_before or 0.0 for record in worked[1:])
    tail = profile.device_tail or 0.0
    wall = profile.wall
    source = "device events" if profile.device is not None else "CPU: the launch's host interval is the forward"
    print(f"wall {wall:.3f} s on the device timeline ({source}):")
    print(f"  before the first step's work {head:8.3f} s {share(head, wall)}")
    print(f"  device busy in steps         {busy:8.3f} s {share(busy, wall)}   (sum of per-step device spans)")
    print(f"  device idle between steps    {idle:8.3f} s {share(idle, wall)}   (host gaps)")
    print(f"  after the last step          {tail:8.3f} s {share(tail, wall)}")
    total = head + busy + idle + tail
    print(
        f"  sum {total:.3f} s = {total / wall:.3f}x the host's wall; not covered by device work: "
        f"{wall - busy:.3f} s ({share(wall - busy, wall).strip()})"
    )


def print_host(profile: StepProfile) -> None:
    records, wall = profile.records, profile.wall
    before = sum(record.before_launch for record in records)
    launch = sum(record.launch for record in records)
    wait = sum(record.wait for record in records)
    rest = sum(record.end - record.start for record in records) - before - launch - wait
    outside = wall - sum(record.end - record.start for record in records)
    print(f"host: {len(records)} step calls in {wall:.3f} s")
    for name, seconds in (
        ("scheduling, before the launch", before),
        ("launch (execute_model)", launch),
        ("waiting for tokens (result)", wait),
        ("rest of the core step (update)", rest),
        ("outside the core step", outside),
    ):
        print(f"  {name:32} {seconds:8.3f} s {share(seconds, wall)}   {ms(seconds / max(len(records), 1))} ms/call")


def print_phases(profile: StepProfile) -> None:
    by_phase: dict[str, list[tuple[StepRecord, float]]] = defaultdict(list)
    for record, call in zip(profile.records, call_walls(profile), strict=False):
        by_phase[record.phase].append((record, call))
    wall = profile.wall
    print(
        "per phase (time: device span plus the device idle before each step; host: call-to-call wall of the calls "
        "that launched them):"
    )
    print(
        f"  {'phase':13} {'steps':>5} {'device s':>9} {'idle s':>8} {'share':>6} {'host s':>8} {'prefill':>8} "
        f"{'decode':>8} {'sampled':>8} {'tok/s':>10} {'out tok/s':>10} {'dev ms':>7} {'launch':>7} {'before':>7} "
        f"{'wait':>7}"
    )
    for phase in PHASES:
        entries = by_phase.get(phase, [])
        if not entries:
            continue
        records = [record for record, _ in entries]
        device = sum(record.device or 0.0 for record in records)
        idle = sum(record.idle_before or 0.0 for record in records)
        host = sum(call for _, call in entries)
        prefill = sum(record.prefill_tokens for record in records)
        decode = sum(record.decode_tokens for record in records)
        sampled = sum(record.sampled_tokens for record in records)
        time_ = device + idle
        count = len(records)
        print(
            f"  {phase:13} {count:5d} {device:9.3f} {idle:8.3f} {share(time_, wall)} {host:8.3f} {prefill:8d} "
            f"{decode:8d} {sampled:8d} {rate(prefill + decode, time_)} {rate(sampled, time_)} "
            f"{ms(device / count):>7} "
            f"{ms(sum(r.launch for r in records) / count):>7} {ms(sum(r.before_launch for r in records) / count):>7} "
            f"{ms(sum(r.wait for r in records) / count):>7}"
        )


def rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:10,.0f}" if seconds > 0 and tokens else f"{'-':>10}"


def call_walls(profile: StepProfile) -> list[float]:
    """Host seconds from each call's start to the next one's (the last: to the end of recording)."""
    starts = [record.start for record in profile.records] + [profile.wall]
    return [after - before for before, after in zip(starts, starts[1:], strict=False)]


def print_gaps(profile: StepProfile, count: int = 5) -> None:
    indexed = [(index, record) for index, record in enumerate(profile.records) if record.requests]
    largest = sorted(indexed[1:], key=lambda item: -(item[1].idle_before or 0.0))[:count]
    print(
        "largest device-idle gaps before a step: "
        + ", ".join(f"#{index} {ms(record.idle_before)} ms ({record.phase})" for index, record in largest)
    )


def print_decode_batches(profile: StepProfile) -> None:
    buckets: dict[int, list[StepRecord]] = defaultdict(list)
    for record in profile.records:
        if record.phase.startswith("decode"):
            buckets[record.requests.bit_length()].append(record)
    print("decode steps by batch size:")
    print(
        f"  {'batch':>9} {'steps':>5} {'graph':>5} {'eager':>5} {'mean':>6} {'dev ms':>7} {'idle ms':>7} "
        f"{'out tok/s':>10}"
    )
    for bits in sorted(buckets):
        records = buckets[bits]
        low, high = 1 << (bits - 1), (1 << bits) - 1
        graphs = sum(record.graph_size is not None for record in records)
        device = sum(record.device or 0.0 for record in records)
        idle = sum(record.idle_before or 0.0 for record in records)
        sampled = sum(record.sampled_tokens for record in records)
        count = len(records)
        print(
            f"  {f'{low}-{high}' if high > low else str(low):>9} {count:5d} {graphs:5d} {count - graphs:5d} "
            f"{sum(r.requests for r in records) / count:6.1f} {ms(device / count):>7} {ms(idle / count):>7} "
            f"{rate(sampled, device + idle)}"
        )


def print_steps(profile: StepProfile, shown: int) -> None:
    records = profile.records
    rows = (
        list(range(len(records)))
        if len(records) <= 2 * shown
        else [*range(shown), -1, *range(len(records) - shown, len(records))]
    )
    print("steps (ms; 'wait' is for the tokens this call applies: with asynchronous scheduling the step before's):")
    print(
        f"  {'#':>4} {'t':>9} {'phase':13} {'graph':>5} {'run':>4} {'queue':>5} {'reqs':>4} {'prefill':>7} "
        f"{'decode':>6} {'before':>7} {'launch':>7} {'wait':>7} {'call':>7} {'to next':>7} {'device':>7} {'idle':>7}"
    )
    walls = call_walls(profile)
    for index in rows:
        if index < 0:
            print(f"  {'...':>4}")
            continue
        record = records[index]
        print(
            f"  {index:4d} {ms(record.start):>9} {record.phase:13} {record.graph_size or '-':>5} {record.running:4d} "
            f"{record.waiting:5d} {record.requests:4d} {record.prefill_tokens:7d} {record.decode_tokens:6d} "
            f"{ms(record.before_launch):>7} {ms(record.launch):>7} {ms(record.wait):>7} "
            f"{ms(record.end - record.start):>7} {ms(walls[index] - (record.end - record.start)):>7} "
            f"{ms(record.device):>7} {ms(record.idle_before):>7}"
        )


class GarbageCollections:
    """The garbage collector's pauses during the profiled run (``gc.callbacks``), by generation."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses[info["generation"]].append(time.perf_counter() - self._started)

    def report(self) -> None:
        parts = [
            f"generation {generation}: {len(pauses)} in {sum(pauses):.3f} s (longest "
            f"{max(pauses, default=0) * 1e3:.1f} ms)"
            for generation, pauses in self.pauses.items()
        ]
        print(
            f"garbage collections in the profiled run (objects frozen at start-up: {gc.get_freeze_count():,}): "
            + "; ".join(parts)
        )


def watch_garbage_collections() -> GarbageCollections:
    collections = GarbageCollections()
    gc.callbacks.append(collections.callback)
    return collections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer files (the GPU run)")
    parser.add_argument("--shape", choices=["llama3-8b", "qwen3-0.6b"], default="llama3-8b")
    parser.add_argument("--tiny", action="store_true", help="on the CPU, a random 2-layer Llama")
    parser.add_argument("--requests", type=int, help="default: the workload's (see above)")
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--output", type=int)
    parser.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option (default: none, the platform's)",
    )
    parser.add_argument("--steps", type=int, default=12, help="first and last steps listed")
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="freeze start-up's objects out of the garbage collector's view after the build, as the "
        "engine-core process of weft serve and mp workers do (weft.heap)",
    )
    args = parser.parse_args()
    if not args.tiny and args.tokenizer is None:
        parser.error("the GPU run needs --tokenizer DIR (or --tiny for the CPU run)")
    args.engine = dict(parse_override(assignment) for assignment in args.engine)
    requests, prompt, output = WORKLOADS["tiny" if args.tiny else args.shape]
    requests, prompt, output = args.requests or requests, args.prompt or prompt, args.output or output

    device = "CPU" if args.tiny else torch.cuda.get_device_name()
    print(f"# gpu_step_profile: {device}, torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        llm = build(args, Path(scratch))
        print(f"engine built in {time.perf_counter() - started:.1f} s: {llm.engine.core.describe()}", flush=True)
        if args.freeze:
            from weft.heap import freeze_startup_objects

            freeze_startup_objects()
        vocab = llm.engine.core.source.hf_config["vocab_size"]
        # Other prompts for each run: the measured one must find none of the warm-up's in the prefix cache.
        warm_up, measured = (random_prompts(requests, prompt, vocab, seed) for seed in (2, 1))
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        tokens = requests * output
        name = "tiny llama" if args.tiny else args.shape
        baseline = timed_generate(llm, warm_up, params, None)
        print(
            f"{name} {requests} x ({prompt}, {output}): warm-up run (not profiled) {baseline:.3f} s, "
            f"{tokens / baseline:,.0f} output tok/s",
            flush=True,
        )
        profile = StepProfile(llm.engine.runner)
        cache = llm.engine.kv_cache_manager.stats
        hits = cache.hit_tokens
        collections = watch_garbage_collections()
        seconds = timed_generate(llm, measured, params, profile)
        gc.callbacks.remove(collections.callback)
        print(
            f"profiled run {seconds:.3f} s, {tokens / seconds:,.0f} output tok/s = {seconds / baseline:.3f}x the "
            f"warm-up run's wall (the profile's overhead, and run-to-run noise); prefix-cache hits "
            f"{cache.hit_tokens - hits} tokens",
            flush=True,
        )
        print_wall(profile)
        collections.report()
        print_host(profile)
        print_phases(profile)
        print_gaps(profile)
        print_decode_batches(profile)
        print_steps(profile, args.steps)
        llm.close()
    print(f"# done in {time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
