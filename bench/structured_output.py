"""Structured-output overhead: batch-32 decode throughput with a JSON schema on every request against none.

Both runs decode the same prompts greedily for the same number of tokens, in the same engine:
the baseline samples freely (``ignore_eos``, so every request decodes every token), the others
constrain every request with a JSON schema that cannot complete within that many tokens (a long
array of records, and the worst case, a long array of length-bounded strings: :data:`SCHEMAS`), so
every token is sampled under its grammar mask. Prefill is left
out: the clock starts once every request has its first token. Each mode runs ``--repeats`` times,
alternating which goes first; the best of each is compared. Wanted: ratio >= 0.8.

    python bench/structured_output.py                                   # CPU, the default model
    python bench/structured_output.py --tiny                            # CPU, host-bound: a 2-layer random Llama
    python bench/structured_output.py --gpu --tokenizer .whl/tokenizer  # GPU, SmolLM2-135M's shape, random weights

``--executor mp`` runs the model in a worker process of its own (``engine.distributed_executor_backend``,
one worker), both modes alike: the engine core keeps scheduling and the grammar fill, which then share
no GIL with the forward's input preparation and launch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from weft import LLM, SamplingParams
from weft.contracts.structured_output import StructuredOutputsParams

SCHEMAS = {
    "records": {
        "type": "array",
        "minItems": 4000,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "email": {"type": "string"},
                "active": {"type": "boolean"},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"],
                },
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "role"],
        },
    },
    "short-strings": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 4000},
}
"""Schemas that no run can complete (far more items than tokens decoded), so every row is masked at every step.
``records``: what an application asks for (objects with required fields, an enum, integers, booleans, free
strings, a nested object and array). ``short-strings``: the worst case found for xgrammar, every row inside a
length-bounded string, where the mask of almost the whole vocabulary depends on the string's length so far."""


class Timeline:
    """Host time per phase of the timed steps (``--timeline``): each wrapped call's duration, summed per phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.recording = False
        self.steps = 0

    def wrap(self, owner: object, attribute: str, phase: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args: object, **kwargs: object) -> object:
            if not self.recording:
                return inner(*args, **kwargs)
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - began

        setattr(owner, attribute, timed)

    def install(self, llm: LLM) -> None:
        engine = llm.engine
        core = engine.core
        self.wrap(core.scheduler, "schedule", "main: schedule")
        self.wrap(core.scheduler, "update_from_output", "main: update_from_output")
        self.wrap(core, "_apply", "main: _apply (wait tokens + update)")
        self.wrap(core, "_execute", "main: execute_model (launch)")
        self.wrap(core.executor, "sample_tokens", "main: sample_tokens (mask + sample)")
        self.wrap(core, "_take_bitmask", "main: wait for the mask")
        self.wrap(engine.outputs, "process", "main: output processing")
        self.wrap(engine, "step", "main: whole step")
        worker = getattr(core.executor, "worker", None)
        runner = getattr(worker, "runner", None)
        if runner is not None:
            self.wrap(runner.token_bitmask, "apply", "main: TokenBitmask.apply")
            self.wrap(runner, "_forward", "main: runner._forward")
            self.wrap(runner.decode_graphs, "stage_ahead", "main: DecodeGraphs.stage_ahead (while the mask fills)")
            self.wrap(runner, "_sample_step", "main: runner._sample_step")
            self.wrap(runner.sampler, "sample", "main: Sampler.sample")
            self.wrap(runner.token_counts, "record", "main: TokenCounts.record")
        if runner is not None:
            self.wrap(runner, "sample_tokens", "main: runner.sample_tokens (mask + argmax launch)")
            self.wrap(runner.token_bitmask, "argmax", "main: TokenBitmask.argmax")
            if runner.mask_graphs is not None:
                self.wrap(runner.mask_graphs, "sample", "main: MaskGraphs.sample (stage, copy, replay)")
        if core.scheduler.structured_outputs is not None:
            manager = core.scheduler.structured_outputs
            if manager.fills_in_process:
                group = manager._process.result()
                self.wrap(group, "send_step", "main: FillGroup.send_step")
                self.wrap(group, "receive_step", "main: FillGroup.receive_step (waits for the children)")
                self.wrap(group, "rows", "main: FillGroup.rows")
            self.wrap(manager, "grammar_output", "main: send the fill's message")
            self.wrap(manager, "accept", "main: StructuredOutputManager.accept")
            self.wrap(manager, "_accept_and_fill", "fill thread: accept + fill")
            self.wrap(manager, "_fill", "fill thread: fill")
            self.wrap(manager, "_finish_remote", "main: read the fill process's answer")

    def report(self, name: str, steps: int) -> None:
        print(f"  timeline of {name} ({steps} steps), ms per step:")
        for phase, total in sorted(self.totals.items()):
            print(f"    {phase:42} {1000 * total / max(steps, 1):8.3f}")
        self.totals = {}


TIMELINE: Timeline | None = None


def decode_seconds(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Seconds from every request's first token to the last request's end, and the tokens decoded meanwhile."""
    engine = llm.engine
    states = [
        engine.add_request(f"bench-{time.monotonic_ns()}-{index}", prompt, params, stream_text=False)
        for index, prompt in enumerate(prompts)
    ]
    while any(not state.output_token_ids for state in states):
        engine.step()
    started = time.perf_counter()
    first = sum(len(state.output_token_ids) for state in states)
    steps = 0
    if TIMELINE is not None:
        TIMELINE.recording = True
    while engine.has_unfinished:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - started
    if TIMELINE is not None:
        TIMELINE.recording = False
        TIMELINE.steps = steps
    return seconds, sum(len(state.output_token_ids) for state in states) - first


def fill_where(manager: object) -> str:
    if manager is None or not manager.fills_in_process:  # type: ignore[attr-defined]
        return "a thread of the core"
    count = len(manager._process.result().children)  # type: ignore[attr-defined]
    return f"{count} process{'' if count == 1 else 'es'} of their own"


def tiny_model(folder: Path, **sizes: object) -> str:
    """tests/conftest.py's random 2-layer Llama (hidden size 64) with SmolLM2's tokenizer: a forward so small
    that the step is host-bound on a CPU, as the 135M shape's is on a GPU. ``sizes``: config values to override."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from transformers import AutoTokenizer

    from conftest import make_tiny_model, smollm2_gguf

    gguf = smollm2_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder / "tokenizer"))
    return str(make_tiny_model(folder / "llama", "llama", folder / "tokenizer", **sizes))


def build(args: argparse.Namespace, scratch: Path) -> LLM:
    plugins = {"xgrammar": {"fill_threads": args.fill_threads}} if args.fill_threads else {}
    engine = {
        "max_num_seqs": args.batch,
        "distributed_executor_backend": args.executor,
        "structured_output_fill": args.fill,
    }
    if args.fill_processes:
        engine["structured_output_fill_processes"] = args.fill_processes
    if args.tiny:
        import torch

        # A forward this small gains nothing from threads that contend with the fill's (an mp worker sets
        # its own: the node's cores).
        torch.set_num_threads(1)
        # The GPU run's engine settings (asynchronous scheduling is off by default on a CPU).
        return LLM(model=tiny_model(scratch), engine={**engine, "async_scheduling": True}, plugins=plugins)
    if not args.gpu:
        return LLM(model=args.model, engine=engine, plugins=plugins)
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_common import install_random_loader

    # Seeded random weights made in the process that loads them (an mp worker makes the same ones), with the
    # tokenizer the grammar is compiled against.
    install_random_loader(scratch / "site")
    if args.tokenizer:
        os.environ["WEFT_TEST_TOKENIZER"] = str(Path(args.tokenizer).resolve())
    model = "random:smollm2-135m" if args.shape == "smollm2-135m" else "random:llama3-8b-smollm2-vocab"
    return LLM(model=model, use={"platform": "cuda"}, engine={**engine, "dtype": "bfloat16"}, plugins=plugins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the CPU run's model")
    parser.add_argument("--tiny", action="store_true", help="the CPU run on a random 2-layer Llama (host-bound)")
    parser.add_argument("--gpu", action="store_true", help="on the GPU, SmolLM2-135M's shape with random weights")
    parser.add_argument("--tokenizer", help="SmolLM2's tokenizer files (the GPU run; default: $WEFT_TEST_TOKENIZER)")
    parser.add_argument(
        "--shape",
        choices=["smollm2-135m", "llama3-8b"],
        default="smollm2-135m",
        help="the GPU run's layers (llama3-8b: Llama-3-8B's over SmolLM2's vocabulary)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fill-threads", type=int, help="plugins.xgrammar.fill_threads (default: the plugin's)")
    parser.add_argument(
        "--schema",
        choices=sorted(SCHEMAS),
        action="append",
        help="the schema(s) to constrain with (repeatable; default: every one, each against the plain run)",
    )
    parser.add_argument(
        "--executor",
        choices=["uniproc", "mp"],
        default="uniproc",
        help="engine.distributed_executor_backend for both modes (mp: the model in one worker process)",
    )
    parser.add_argument(
        "--fill",
        choices=["auto", "thread", "process"],
        default="auto",
        help="engine.structured_output_fill: the matchers in a thread of the core or a process of their own",
    )
    parser.add_argument(
        "--fill-processes",
        type=int,
        help="engine.structured_output_fill_processes (default: the engine's, one per 4 CPUs, at most 4)",
    )
    parser.add_argument(
        "--without-launch-ahead",
        action="store_true",
        help="also run each schema with the executor's launch_ahead off (each step's forward launched "
        "after the step before sampled, its inputs staged then), in the same engine",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="then one more run of each mode, printing the host time of each phase per step",
    )
    args = parser.parse_args()
    if args.gpu and not (args.tokenizer or os.environ.get("WEFT_TEST_TOKENIZER")):
        parser.error("--gpu needs SmolLM2's tokenizer files: --tokenizer DIR, or $WEFT_TEST_TOKENIZER")
    with tempfile.TemporaryDirectory() as scratch:
        run(args, build(args, Path(scratch)))


def run(args: argparse.Namespace, llm: LLM) -> None:
    tokenizer = llm.tokenizer
    prompts = [
        tokenizer.encode(f"Write a list of {index + 3} short words as a JSON array:") for index in range(args.batch)
    ]
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    modes = [("plain", plain)] + [
        (
            name,
            SamplingParams(
                temperature=0,
                max_tokens=args.tokens,
                ignore_eos=True,
                structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]),
            ),
        )
        for name in args.schema or sorted(SCHEMAS)
    ]
    executor = llm.engine.core.executor
    launch_ahead = {name: executor.launch_ahead for name, _ in modes}
    if args.without_launch_ahead and executor.launch_ahead:
        for name, params in modes[1:]:
            modes.append((f"{name}, not ahead", params))
            launch_ahead[f"{name}, not ahead"] = False
    for _, params in modes:
        decode_seconds(llm, prompts[:2], params)  # compile the schemas, warm every path up
    best = {name: 0.0 for name, _ in modes}
    runs: dict[str, list[float]] = {name: [] for name, _ in modes}
    for repeat in range(args.repeats):
        for name, params in modes if repeat % 2 == 0 else modes[::-1]:  # alternate which mode runs first
            executor.launch_ahead = launch_ahead[name]
            seconds, tokens = decode_seconds(llm, prompts, params)
            runs[name].append(tokens / seconds)
            best[name] = max(best[name], tokens / seconds)
    settings = llm.engine.core.describe()
    print(
        "engine: "
        f"{'GPU, random ' + args.shape + ' shape' if args.gpu else 'random tiny Llama' if args.tiny else args.model}; "
        f"{settings}"
    )
    manager = llm.engine.core.scheduler.structured_outputs
    print(
        f"executor: {llm.engine.core.executor.name}; batch {args.batch}, {args.tokens} decoded tokens per request, "
        f"greedy, best of {args.repeats}; xgrammar fill threads: {args.fill_threads or 'default'}; matchers in "
        f"{fill_where(manager)} "
        f"(engine.structured_output_fill = {args.fill!r}); executor.launch_ahead: {launch_ahead['plain']}"
    )
    for name, _ in modes:
        print(f"  {name + ':':14} {best[name]:10.1f} tok/s  (runs: {', '.join(f'{rate:.1f}' for rate in runs[name])})")
    for name, _ in modes[1:]:
        print(f"  ratio {name} schema / plain: {best[name] / best['plain']:.3f} (wanted >= 0.8)")
    if args.timeline:
        global TIMELINE
        TIMELINE = Timeline()
        TIMELINE.install(llm)
        for name, params in modes:
            executor.launch_ahead = launch_ahead[name]
            seconds, tokens = decode_seconds(llm, prompts, params)
            TIMELINE.report(f"{name}, {tokens / seconds:.1f} tok/s", TIMELINE.steps)
        TIMELINE = None
    llm.close()


if __name__ == "__main__":
    main()
