"""Speculative decoding against plain decoding, measured in the same run.

Two parts:

* ``--part cpu``: the default model (SmolLM2-135M-Instruct, its GGUF on the quantized CPU path) at batch 1, on a
  chat prompt that asks to repeat a passage of about 300 tokens with small edits: ``ngram`` with k = 4 against
  speculation off, alternating runs in one process. Target (issue 44): at least 1.8x the tokens/s.
* ``--part gpu``: the Llama-3-8B shape in bf16 with random weights on one GPU, with a bench-only ``replay``
  speculator that proposes the target's own greedy continuation (recorded by a plain run first), so every
  proposal is accepted and only the verification machinery is measured: k = 4 against plain decode at batch 1
  and batch 64. Targets: 3.0x at batch 1, 1.5x at batch 64. Both engines capture graphs (plain decoding its decode
  graphs, speculation its verify graphs too: docs/speculative.md) unless ``--enforce-eager``; the line says how
  many speculating steps replayed a verify graph.

Usage::

    python bench/spec_decode.py --part cpu
    python bench/spec_decode.py --part gpu --tokenizer DIR     # DIR: SmolLM2's tokenizer files
    python bench/spec_decode.py --part gpu --tokenizer DIR --enforce-eager   # both engines eager, for comparison

Prints each run's tokens/s, the acceptance the engine's counters report, and the ratio.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PASSAGE = (
    "The old lighthouse stood at the edge of the harbour for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until the beam reached far out over "
    "the water. Fishermen coming home in the dark looked for that light before anything else, because it told "
    "them where the rocks were and where the channel ran deep and safe. In the winter storms the waves broke over "
    "the lower windows, and the keeper's cat would sleep on the warm stones beside the lamp while the wind shook "
    "the door. When the town finally built an electric beacon on the new breakwater, the lighthouse went dark, "
    "but the people of the harbour kept it painted white and red, and on the first evening of every summer they "
    "lit the old lamp again, so that the children could see how their grandparents had found their way home. "
    "The keeper's logbooks, filled with neat handwriting about weather, ships and the cat, are kept in the small "
    "museum by the market, and visitors still read them aloud to each other on rainy afternoons."
)
EDIT_INSTRUCTION = (
    "Repeat the following passage word for word, but write 'dog' instead of 'cat' and 'village' instead of "
    "'town'. Output only the passage.\n\n"
)


def tokens_per_second(llm, prompts: Sequence, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    return produced / seconds, produced


def acceptance(llm) -> str:
    stats = llm.engine.core.stats()
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    if not drafted:
        return "no proposals"
    per_step = 1 + accepted / max(stats.spec_decode_num_drafts, 1)
    return f"acceptance {accepted / drafted:.1%} of {drafted} proposals, {per_step:.2f} tokens per verified row"


def part_cpu(args: argparse.Namespace) -> None:
    from weft import LLM, SamplingParams

    engine = {"max_num_seqs": 4}
    plain = LLM(engine=engine)
    ngram = LLM(
        engine={**engine, "speculative": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}}
    )
    tokenizer = plain.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": EDIT_INSTRUCTION + PASSAGE}], add_generation_prompt=True
    )
    passage_tokens = len(tokenizer.encode(PASSAGE))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    same = (
        plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        == ngram.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    print(f"cpu: default model, batch 1, passage of {passage_tokens} tokens; greedy output identical: {same}")
    rates: dict[str, list[float]] = {"off": [], "ngram k=4": []}
    for _ in range(args.rounds):
        for name, llm in (("off", plain), ("ngram k=4", ngram)):
            rate, produced = tokens_per_second(llm, [prompt], params)
            rates[name].append(rate)
    for name, runs in rates.items():
        print(f"cpu {name}: {', '.join(f'{rate:.1f}' for rate in runs)} tokens/s ({produced} tokens per run)")
    print(f"cpu ngram: {acceptance(ngram)}")
    ratio = max(rates["ngram k=4"]) / max(rates["off"])
    print(f"cpu: ngram k=4 / off = {ratio:.2f}x (target 1.8x)")
    plain.close()
    ngram.close()


def token_driven(weights):
    """Random weights whose greedy path no rounding can flip: the next greedy token is a fixed permutation of the
    current one, by a wide margin.

    Every residual branch's output projection (``o_proj``, ``down_proj``) is scaled by 1e-4, so the residual stream
    is the current token's embedding plus contributions under 1% of it; and the LM head's rows are the embedding's
    rows in a random order, so the logit of the token the permutation picks is the embedding's squared norm (about
    4096 x 0.02^2 before the final norm) where every other is a random inner product some 64 times smaller. The
    timing is unchanged (the same shapes, the same bytes). With N(0, 0.02) weights throughout the greedy path is
    chaotic, and bf16 logits tie often (their resolution near the top logit is about 0.4% of it): the verify step's
    prefill launch and plain decoding's split-key decode launch round differently (both within bf16 of exact
    attention, bench/gpu_probe_verify.py), a near tie flips within a few tokens, and no replayed proposal matches
    after it. Damping the branches alone left that: acceptance 8-10% on the H200 (2026-12-07)."""

    def scaled():
        import torch

        embedding, head = None, None
        for name, tensor in weights():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                yield name, tensor * 1e-4
            elif name == "lm_head.weight":
                head = name  # made from the embedding, which may come later
            else:
                if name.endswith("embed_tokens.weight"):
                    embedding = tensor
                yield name, tensor
        if head is not None:
            assert embedding is not None, "token_driven: no embed_tokens.weight"
            generator = torch.Generator(device=embedding.device).manual_seed(1)
            order = torch.randperm(embedding.shape[0], generator=generator, device=embedding.device)
            yield head, embedding[order].clone()

    return scaled


def part_gpu(args: argparse.Namespace) -> None:
    import torch

    from gpu_common import LLAMA3_8B, MemoryLoader, random_weights
    from replay_speculator import ReplaySpeculator, registry_with_replay
    from weft import LLM, SamplingParams

    output = args.gpu_output
    model = MemoryLoader.add(
        "llama3-8b", LLAMA3_8B, token_driven(random_weights(LLAMA3_8B, torch.bfloat16)), args.tokenizer
    )
    registry = registry_with_replay()
    engine = {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": args.enforce_eager}
    generator = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = torch.randint(1000, 100000, (batch, 128), generator=generator).tolist()
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        plain = LLM(model=model, registry=registry, use={"platform": "cuda"}, engine=engine)
        tokens_per_second(plain, prompts[: min(batch, 4)], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        reference = plain.generate(prompts, params, use_tqdm=False)
        ReplaySpeculator.continuations = {
            tuple(prompt): list(result.outputs[0].token_ids) for prompt, result in zip(prompts, reference, strict=True)
        }
        plain_runs = [tokens_per_second(plain, prompts, params)[0] for _ in range(args.rounds)]
        plain.close()
        del plain
        gc.collect()
        torch.cuda.empty_cache()
        spec = LLM(
            model=model,
            registry=registry,
            use={"platform": "cuda"},
            engine={**engine, "speculative": {"method": "replay", "num_speculative_tokens": 4}},
        )
        tokens_per_second(spec, prompts[: min(batch, 4)], SamplingParams(temperature=0, max_tokens=8))
        same = [result.outputs[0].token_ids for result in spec.generate(prompts, params, use_tqdm=False)] == [
            result.outputs[0].token_ids for result in reference
        ]
        spec_runs = [tokens_per_second(spec, prompts, params)[0] for _ in range(args.rounds)]
        verify = spec.engine.runner.verify_graphs
        path = (
            f"verify graphs {sorted(verify.graphs)} replayed {verify.replays} times"
            if verify.graphs
            else "speculating steps eager"
        )
        print(
            f"gpu llama3-8b bf16 batch {batch} x (128, {output}): plain "
            f"{', '.join(f'{rate:,.0f}' for rate in plain_runs)} tokens/s; replay k=4 "
            f"{', '.join(f'{rate:,.0f}' for rate in spec_runs)} tokens/s; identical {same}; {acceptance(spec)}; "
            f"{path}; "
            f"ratio {max(spec_runs) / max(plain_runs):.2f}x (target {'3.0' if batch == 1 else '1.5'}x)",
            flush=True,
        )
        spec.close()
        del spec
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cpu", "gpu"], action="append", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--gpu-output", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--enforce-eager", action="store_true", help="gpu: capture no graphs (default: graphs)")
    args = parser.parse_args()
    if "cpu" in args.part:
        part_cpu(args)
    if "gpu" in args.part:
        part_gpu(args)


if __name__ == "__main__":
    main()
