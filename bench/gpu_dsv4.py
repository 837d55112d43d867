"""weft-dsv4 on an NVIDIA GPU: decode throughput against transformers' ``generate()`` in the same run,
on a random DeepSeek V4 config larger than the CPU tests' (bf16, Triton decode_topk in the indexer).

Both sides load the same checkpoint (random weights, written by ``weft_dsv4.tiny_checkpoint``),
generate greedily for the same batch of equal-length prompts (no padding: transformers' V4
compressor ignores attention masks), EOS ignored. Decode throughput = batch x (new tokens - 1)
/ (time for N tokens - time for 1 token), so prefill is excluded on both sides; medians of
``--repeats`` runs. Also printed: how many leading greedy tokens the two bf16 runs share. The long-context
case is ``--prompt-len 32768 --batch 1 --heads 4``: transformers' eager attention holds every head's full
[prompt, prompt] scores in prefill, which at 16 heads does not fit in an H200's memory.

    python bench/gpu_dsv4.py [--batch 16] [--prompt-len 512] [--new-tokens 128] [--out DIR]

``--part hisparse``: how many concurrent long requests fit in the same KV-cache memory with weft-hisparse
(the CSA entries in a host pool, the GPU pages a write-back cache) against without, and the decode
throughput of each. Each side runs in its own process with the same KV-cache bytes (``--kv-gib``),
``--requests`` prompts of ``--prompt-len`` tokens (32k by default) and greedy decoding; printed: the most
requests holding blocks at once (and the GPU bytes HiSparse's decode graphs hold outside that memory, their hot
buffer and page table), the blocks of each group, decode tokens per second over the steps that
only decode, and where the two sides' greedy tokens differ (near-ties or not); then plain once more with
the memory to hold HiSparse's requests, each request arriving just before the step HiSparse first scheduled
it and each step's token budget what HiSparse scheduled in it, decoding eagerly as HiSparse does, so that both
run the same batches step by step: its tokens and log-probabilities must then be HiSparse's exactly.

    python bench/gpu_dsv4.py --part hisparse [--requests 64] [--prompt-len 32768] [--new-tokens 64] [--kv-gib 1]

``--part prefill``: prefill throughput with attention in the Triton prefill kernel against the einsum path,
in one engine (the layers' kernel chosen away for the baseline): ``--batch`` prompts of ``--prompt-len`` tokens
(4 of 4,096 by default) in steps of ``--chunk`` tokens, one new token each, prefix caching off; prompt tokens per
second over the median of ``--repeats`` runs, and whether both paths pick the same first tokens.

    python bench/gpu_dsv4.py --part prefill [--batch 4] [--prompt-len 4096] [--chunk 8192]

Figures are printed and written to ``$OUT/gpu_dsv4.json`` (``$OUT/gpu_dsv4_hisparse.json``,
``$OUT/gpu_dsv4_prefill.json``; ``--out`` or the environment's $OUT).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHORT = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention", "sliding": "sliding_attention"}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer-types", default="hca,csa,csa,hca,sliding,csa,hca,csa")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--q-lora-rank", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--experts-per-token", type=int, default=4)
    parser.add_argument("--moe-intermediate-size", type=int, default=512)
    parser.add_argument("--hc-mult", type=int, default=4)
    parser.add_argument("--sliding-window", type=int, default=128)
    parser.add_argument("--hca-rate", type=int, default=64)
    parser.add_argument("--index-topk", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of this script)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_dsv4.json (default: $OUT)")
    parser.add_argument("--enforce-eager", action="store_true", help="decode: Weft without CUDA graphs")
    parser.add_argument("--part", default="decode", choices=("decode", "hisparse", "prefill"))
    parser.add_argument("--chunk", type=int, default=8192, help="prefill: tokens a step (max_num_batched_tokens)")
    parser.add_argument("--requests", type=int, default=64, help="hisparse: long requests submitted at once")
    parser.add_argument("--kv-gib", type=float, default=1.0, help="hisparse: KV-cache memory of each side, GiB")
    parser.add_argument(
        "--gpu-share", type=float, default=0.1, help="hisparse: share of it for the CSA entries' GPU pages"
    )
    parser.add_argument(
        "--indexer-key-dtype",
        default="auto",
        choices=("auto", "fp8_e4m3"),
        help="hisparse: how both sides store the indexer's keys ([plugins.DeepseekV4ForCausalLM])",
    )
    parser.add_argument("--side", choices=("plain", "hisparse"), help=argparse.SUPPRESS)
    parser.add_argument("--side-admit", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part == "hisparse" and "--prompt-len" not in sys.argv:
        args.prompt_len = 32768
    if args.part == "hisparse" and "--new-tokens" not in sys.argv:
        args.new_tokens = 64
    if args.part == "prefill":
        args.prompt_len = args.prompt_len if "--prompt-len" in sys.argv else 4096
        args.batch = args.batch if "--batch" in sys.argv else 4
        args.new_tokens = 1
    return args


def config_of(args: argparse.Namespace) -> dict:
    from weft_dsv4.tiny_checkpoint import tiny_config

    kinds = [SHORT[kind] for kind in args.layer_types.split(",")]
    return tiny_config(
        kinds,
        hc_mult=args.hc_mult,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_attention_heads=args.heads,
        head_dim=args.head_dim,
        q_lora_rank=args.q_lora_rank,
        moe_intermediate_size=args.moe_intermediate_size,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.experts_per_token,
        o_groups=4,
        o_lora_rank=args.hidden_size // 4,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=args.index_topk,
        sliding_window=args.sliding_window,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": args.hca_rate},
        max_position_embeddings=max(8192, args.prompt_len + args.new_tokens + 16),
    )


def timed(run, device: str) -> tuple[float, object]:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def hisparse_side(args: argparse.Namespace) -> dict:
    """One side of ``--part hisparse`` (its own process): the most requests holding blocks at once, and decode speed."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams
    from weft_dsv4.tiny_checkpoint import write_checkpoint

    folder = write_checkpoint(Path(tempfile.mkdtemp()) / "dsv4", config_of(args), seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab_size, (args.requests, args.prompt_len), generator=generator).tolist()
    max_model_len = args.prompt_len + args.new_tokens + 16
    kv_bytes = int(args.kv_gib * (1 << 30))
    engine = {
        "dtype": args.dtype,
        "block_size": 16,
        "max_model_len": max_model_len,
        "max_num_seqs": args.requests,
        "max_num_batched_tokens": 8192,
        "enable_prefix_caching": False,
        "enforce_eager": args.enforce_eager,
    }
    if args.device == "cuda":
        engine["gpu_memory_utilization"] = min(0.9, kv_bytes / torch.cuda.mem_get_info()[0])
    else:
        engine["cpu_kv_cache_bytes"] = kv_bytes
    extra = {"plugins": {"DeepseekV4ForCausalLM": {"indexer_key_dtype": args.indexer_key_dtype}}}
    if args.side == "hisparse":
        pages = -(-max_model_len // 16)  # csa_kv pages (16 tokens, 4 entries) of one request
        extra["use"] = {"kv_connector": "hisparse"}
        extra["plugins"]["hisparse"] = {
            "host_pages": args.requests * pages + 16,
            "hot_buffer_blocks": -(-args.index_topk // 4),
            "gpu_share": args.gpu_share,
        }
    llm = LLM(model=str(folder), engine=engine, **extra)
    core = llm.engine.core
    scheduler = core.scheduler
    schedule = scheduler.schedule
    steps: list[tuple[float, int, bool]] = []
    batches: list[list[tuple[str, int]]] = []
    """Each step's requests and their scheduled tokens: alike on both sides means alike GEMM shapes."""
    most = [0]

    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=2)
    recorded = json.loads(Path(args.side_admit).read_text()) if args.side_admit else None
    admit = {int(index): at for index, at in recorded["first_step"].items()} if recorded else None
    """Replay: request ``index`` reaches the engine just before the step that scheduled it first on the side
    recorded."""
    budgets = recorded["budgets"] if recorded else None
    """Replay: each step's token budget, the tokens the side recorded scheduled in it (where its lent blocks, not
    the budget, cut a chunk short, the replay's scheduler cuts it by the budget instead, in the same place)."""
    states: dict[int, object] = {}
    first_step: dict[int, int] = {}

    def add(index: int) -> None:
        states[index] = llm.engine.add_request(f"r{index}", prompts[index], params, stream_text=False)

    def recording():
        for index in sorted(index for index, at in (admit or {}).items() if at <= len(batches) and index not in states):
            add(index)
        if budgets is not None:  # past the recorded steps (a replay that diverged): the engine's own budget again
            scheduler.max_num_batched_tokens = (
                budgets[len(batches)] if len(batches) < len(budgets) else engine["max_num_batched_tokens"]
            )
        output = schedule()
        steps.append(
            (
                time.perf_counter(),
                sum(output.num_scheduled_tokens.values()),
                all(count == 1 for count in output.num_scheduled_tokens.values()),
            )
        )
        if output.num_scheduled_tokens:
            for request_id in output.num_scheduled_tokens:
                first_step.setdefault(int(request_id[1:]), len(batches))
            batches.append(sorted(output.num_scheduled_tokens.items()))
        most[0] = max(
            most[0], sum(1 for request in scheduler.running if core.scheduler.kv_cache.holds(request.request_id))
        )
        return output

    scheduler.schedule = recording
    started = time.perf_counter()
    if admit is None:
        for index in range(len(prompts)):
            add(index)
    while len(states) < len(prompts) or llm.engine.has_unfinished:
        llm.engine.step()
    wall = time.perf_counter() - started
    decode_tokens = decode_seconds = 0.0
    for (at, tokens, decode_only), (next_at, _, _) in zip(steps, steps[1:], strict=False):
        if decode_only and tokens:
            decode_tokens += tokens
            decode_seconds += next_at - at
    ordered = [states[index] for index in range(len(prompts))]
    tokens = [list(state.output_token_ids) for state in ordered]
    top2 = [
        [
            sorted(([token, entry.logprob] for token, entry in step.items()), key=lambda pair: -pair[1])[:2]
            for step in state.logprobs or ()
        ]
        for state in ordered
    ]
    totals = core.scheduler.connector.metric_totals if core.scheduler.connector is not None else {}
    return {
        "side": args.side,
        "max_running": most[0],
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "num_blocks": dict(
            zip((group.name for group in core.scheduler.kv_cache.groups), core.num_blocks, strict=False)
        ),
        "preemptions": scheduler.num_preemptions,
        "wall_s": wall,
        "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else None,
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "batches_sha256": hashlib.sha256(json.dumps(batches).encode()).hexdigest(),
        "steps": len(batches),
        "connector": {name: total.total for name, total in totals.items()},
        "tokens": tokens,
        "top2": top2,
        "first_step": first_step,
        "batches": batches,
    }


def hisparse_part(args: argparse.Namespace) -> None:
    """Both sides, each in a fresh process (the same free memory), then the ratio."""
    sides = {}

    def run_side(side: str, *extra: str) -> dict:
        command = [sys.executable, __file__, *sys.argv[1:], "--side", side, *extra]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"the {side} side failed:\n{run.stderr[-4000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
        print(
            json.dumps({key: value for key, value in result.items() if key not in ("tokens", "top2", "batches")}),
            flush=True,
        )  # each side as soon as it is done
        return result

    for side in ("plain", "hisparse"):
        sides[side] = run_side(side)
    plain, sparse = sides["plain"], sides["hisparse"]
    # The output check. The two sides above run different batches (HiSparse decodes more requests at once
    # and its admission gate lets prefills in later), so GEMM shapes, summation orders and, through the
    # indexer's top-k, the picked entries differ by rounding. So plain runs once more on HiSparse's batches,
    # step by step: with the memory to hold its requests, each arriving just before the step that first
    # scheduled it, each step's budget what HiSparse scheduled (its lent blocks may cut a chunk short), and
    # in the same graph mode as HiSparse decodes (both capture decode graphs unless --enforce-eager: a graph
    # pads the batch to a captured size, so eager GEMMs would round differently; graphs on and off at the
    # same shapes are tests/test_dsv4_gpu.py's).
    scale = -(-max(sparse["max_running"], 1) // max(plain["max_running"], 1)) + 1
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as admissions:
        json.dump(
            {
                "first_step": sparse["first_step"],
                "budgets": [sum(count for _, count in batch) for batch in sparse["batches"]],
            },
            admissions,
        )
    replay = run_side("plain", "--kv-gib", str(args.kv_gib * scale), "--side-admit", admissions.name)
    os.unlink(admissions.name)
    unlike = next(
        (
            step
            for step, (ours, theirs) in enumerate(zip(replay["batches"], sparse["batches"], strict=False))
            if ours != theirs
        ),
        None,
    )
    if unlike is None and len(replay["batches"]) != len(sparse["batches"]):
        unlike = min(len(replay["batches"]), len(sparse["batches"]))  # one side ran steps the other did not
    replayed = compare_tokens(replay, sparse)
    comparison = compare_tokens(plain, sparse)
    report = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "kv_gib": args.kv_gib,
        "gpu_share": args.gpu_share,
        "plain": plain,
        "hisparse": sparse,
        "concurrency_ratio": sparse["max_running"] / max(plain["max_running"], 1),
        "same_tokens": plain["tokens_sha256"] == sparse["tokens_sha256"],
        "plain_on_hisparse_batches": replay,
        "same_batches_replayed": replay["batches_sha256"] == sparse["batches_sha256"],
        "first_unlike_batch": None
        if unlike is None
        else {
            "step": unlike,
            "plain": replay["batches"][unlike : unlike + 1],
            "hisparse": sparse["batches"][unlike : unlike + 1],
        },
        "same_tokens_replayed": replay["tokens_sha256"] == sparse["tokens_sha256"],
        "divergences_replayed": replayed,
        "divergences": comparison,
        "indexer_key_dtype": args.indexer_key_dtype,
    }
    # HiSparse's decode graphs hold a hot buffer and page table on the GPU outside the KV-cache budget.
    report["graph_buffer_bytes"] = graph_bytes = sparse["connector"].get("graph_buffer_bytes_total", 0)
    for side in (plain, sparse, replay):
        del side["tokens"], side["top2"], side["first_step"], side["batches"]
    publish(
        report,
        args.out,
        "gpu_dsv4_hisparse.json",
        (
            f"{args.prompt_len}-token requests holding blocks at once in {args.kv_gib} GiB of KV cache: "
            f"{plain['max_running']} without HiSparse, {sparse['max_running']} with "
            f"({report['concurrency_ratio']:.2f}x; its decode graphs' hot buffer and page table "
            f"{graph_bytes / (1 << 20):.1f} MiB beside it); decode {plain['decode_tok_s'] or 0:.1f} tok/s without, "
            f"{sparse['decode_tok_s'] or 0:.1f} tok/s with; same greedy tokens: {report['same_tokens']} "
            f"({comparison['summary']}); plain with {args.kv_gib * scale:g} GiB on HiSparse's admissions: batches "
            f"alike {report['same_batches_replayed']}, same tokens {report['same_tokens_replayed']} "
            f"({replayed['summary']})"
        ),
    )


def compare_tokens(plain: dict, sparse: dict) -> dict:
    """Where each request's greedy tokens first differ between the sides, and whether that is a near-tie.

    Up to its first difference a request saw the same tokens on both sides, so there the two sides'
    log-probabilities of the same tokens differ only by rounding (batch shapes, summation orders): the
    largest such difference over every request is this run's *noise*. A divergence is a near-tie when
    each side's pick is the other's runner-up and both sides' top-1/top-2 gaps are within
    ``TIE_SAFETY`` times the noise (``weft verify``'s rule); anything else is a real difference.
    """
    from weft.verify import TIE_SAFETY

    noise, firsts = 0.0, []
    for ours, theirs, ours_top, theirs_top in zip(
        plain["tokens"], sparse["tokens"], plain["top2"], sparse["top2"], strict=False
    ):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        for step in range(first if first is not None else len(ours)):
            mine, other = dict(map(tuple, ours_top[step])), dict(map(tuple, theirs_top[step]))
            noise = max([noise] + [abs(mine[token] - other[token]) for token in mine.keys() & other.keys()])
        if first is not None:
            firsts.append((first, ours_top[first], theirs_top[first]))
    bound = TIE_SAFETY * noise
    divergences = []
    for first, ours_top, theirs_top in firsts:
        plain_gap = ours_top[0][1] - ours_top[1][1] if len(ours_top) > 1 else float("inf")
        sparse_gap = theirs_top[0][1] - theirs_top[1][1] if len(theirs_top) > 1 else float("inf")
        swapped = (
            len(ours_top) > 1
            and len(theirs_top) > 1
            and ours_top[1][0] == theirs_top[0][0]
            and theirs_top[1][0] == ours_top[0][0]
        )
        divergences.append(
            {
                "step": first,
                "plain_gap": plain_gap,
                "hisparse_gap": sparse_gap,
                "tie": swapped and max(plain_gap, sparse_gap) <= bound,
            }
        )
    ties = sum(d["tie"] for d in divergences)
    requests = len(plain["tokens"])
    summary = (
        f"{requests - len(divergences)} of {requests} requests gave the same tokens, {ties} diverged at a near-tie "
        f"(gaps within {TIE_SAFETY} x the run's rounding noise {noise:.3g}), {len(divergences) - ties} beyond one"
    )
    return {
        "noise": noise,
        "tie_bound": bound,
        "divergences": divergences,
        "summary": summary,
        "unchanged": ties == len(divergences),
    }


def prefill_part(args: argparse.Namespace) -> None:
    """Prefill with attention in the Triton kernel, then in the einsum path, in the same engine."""
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams
    from weft_dsv4.tiny_checkpoint import write_checkpoint

    folder = write_checkpoint(Path(tempfile.mkdtemp()) / "dsv4", config_of(args), seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab_size, (args.batch, args.prompt_len), generator=generator).tolist()
    max_model_len = args.prompt_len + 16
    llm = LLM(
        model=str(folder),
        engine={
            "dtype": args.dtype,
            "block_size": 16,
            "max_model_len": max_model_len,
            "max_num_seqs": args.batch,
            "max_num_batched_tokens": max(args.chunk, 16),
            "enable_prefix_caching": False,  # every run prefills in full
            "num_kv_blocks": args.batch * -(-max_model_len // 16) + 64,
        },
    )
    layers = [layer.self_attn for layer in llm.engine.worker.model.model.layers]
    kernel = layers[0].prefill_kernel
    if kernel is None:
        raise SystemExit(f"no Triton prefill attention on {args.device}: the engine chose the einsum path")
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = {}
    for path in ("kernel", "einsum"):
        for layer in layers:
            layer.prefill_kernel = kernel if path == "kernel" else None
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: the allocator primed at these shapes
        runs, outputs = [], None
        for _ in range(args.repeats):
            seconds, outputs = timed(lambda: llm.generate(prompts, params, use_tqdm=False), args.device)
            runs.append(args.batch * args.prompt_len / seconds)
        results[path] = {
            "prefill_tok_s": statistics.median(runs),
            "runs": runs,
            "first_tokens": [output.outputs[0].token_ids[0] for output in outputs],
        }
    kernel_side, einsum_side = results["kernel"], results["einsum"]
    report = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "chunk": args.chunk,
        "config": {k: v for k, v in config_of(args).items() if k != "compress_rates"} | {"hca_rate": args.hca_rate},
        "kernel_prefill_tok_s": kernel_side["prefill_tok_s"],
        "einsum_prefill_tok_s": einsum_side["prefill_tok_s"],
        "ratio_kernel_over_einsum": kernel_side["prefill_tok_s"] / einsum_side["prefill_tok_s"],
        "kernel_runs": kernel_side["runs"],
        "einsum_runs": einsum_side["runs"],
        "same_first_tokens": sum(
            a == b for a, b in zip(kernel_side["first_tokens"], einsum_side["first_tokens"], strict=False)
        ),
    }
    publish(
        report,
        args.out,
        "gpu_dsv4_prefill.json",
        (
            f"prefill throughput, {args.batch} x {args.prompt_len} tokens in steps of {args.chunk}, {args.dtype}: "
            f"Triton kernel {report['kernel_prefill_tok_s']:.0f} tok/s, einsum path "
            f"{report['einsum_prefill_tok_s']:.0f} tok/s, ratio {report['ratio_kernel_over_einsum']:.2f}x; same first "
            f"token: {report['same_first_tokens']} of {args.batch}"
        ),
    )


def publish(report: dict, out: str | None, name: str, summary: str) -> None:
    """Print the report and its one-line summary; write it as ``out/name`` when given a folder."""
    print(json.dumps(report, indent=2))
    print(summary)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(report, indent=2))


def main() -> None:
    args = arguments()
    if args.side is not None:
        print(json.dumps(hisparse_side(args)))
        return
    if args.part == "hisparse":
        hisparse_part(args)
        return
    if args.part == "prefill":
        prefill_part(args)
        return
    import transformers

    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams
    from weft_dsv4.reference import stable_topk
    from weft_dsv4.tiny_checkpoint import write_checkpoint

    dtype = getattr(torch, args.dtype)
    folder = write_checkpoint(Path(tempfile.mkdtemp()) / "dsv4", config_of(args), seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, args.vocab_size, (args.batch, args.prompt_len), generator=generator)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    inputs = prompts.to(args.device)

    def hf_generate(tokens: int):
        with stable_topk(), torch.no_grad():
            return hf.generate(inputs, max_new_tokens=tokens, do_sample=False, pad_token_id=0)

    max_model_len = args.prompt_len + args.new_tokens + 16
    llm = LLM(
        model=str(folder),
        engine={
            "dtype": args.dtype,
            "block_size": 16,
            "max_model_len": max_model_len,
            "max_num_seqs": args.batch,
            "max_num_batched_tokens": max(2048, args.prompt_len),
            # Enough blocks in every group for the whole batch at full length (no preemption).
            "num_kv_blocks": args.batch * -(-max_model_len // 16) + 64,
            "enforce_eager": args.enforce_eager,
        },
    )
    prompt_lists = prompts.tolist()

    def weft_generate(tokens: int):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return llm.generate(prompt_lists, params, use_tqdm=False)

    (
        hf_generate(args.new_tokens),
        weft_generate(args.new_tokens),
    )  # warm-up at full length: every kernel compiled, allocator primed
    results = {}
    for name, generate in (("hf", hf_generate), ("weft", weft_generate)):
        rates, outputs = [], None
        for _ in range(args.repeats):
            first, _ = timed(lambda run=generate: run(1), args.device)
            total, outputs = timed(lambda run=generate: run(args.new_tokens), args.device)
            rates.append(args.batch * (args.new_tokens - 1) / (total - first))
        results[name] = {"decode_tok_s": statistics.median(rates), "runs": rates, "outputs": outputs}

    hf_tokens = results["hf"]["outputs"][:, args.prompt_len :].tolist()
    weft_tokens = [list(output.outputs[0].token_ids) for output in results["weft"]["outputs"]]
    shared = []
    for ours, theirs in zip(weft_tokens, hf_tokens, strict=False):
        count = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
        )
        shared.append(count)
    report = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": args.dtype,
        "batch": args.batch,
        "decode_graphs": sorted(llm.engine.runner.graphs),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "config": {k: v for k, v in config_of(args).items() if k != "compress_rates"} | {"hca_rate": args.hca_rate},
        "hf_decode_tok_s": results["hf"]["decode_tok_s"],
        "weft_decode_tok_s": results["weft"]["decode_tok_s"],
        "ratio_weft_over_hf": results["weft"]["decode_tok_s"] / results["hf"]["decode_tok_s"],
        "hf_runs": results["hf"]["runs"],
        "weft_runs": results["weft"]["runs"],
        "greedy_tokens_shared_with_hf": shared,
    }
    publish(
        report,
        args.out,
        "gpu_dsv4.json",
        (
            f"decode throughput, batch {args.batch}, {args.dtype}, graphs "
            f"{'on' if report['decode_graphs'] else 'off'}: weft {report['weft_decode_tok_s']:.1f} tok/s, HF "
            f"generate() {report['hf_decode_tok_s']:.1f} tok/s, ratio {report['ratio_weft_over_hf']:.2f}x; greedy "
            f"tokens shared with HF (of {args.new_tokens}): median {statistics.median(shared)}"
        ),
    )


if __name__ == "__main__":
    main()
