"""``weft verify MODEL``: a model family checked token for token against its Hugging Face reference."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(commands: Any) -> None:
    verify = commands.add_parser(
        "verify",
        help="check a model family token for token against its Hugging Face reference",
    )
    add_verify_arguments(verify)
    verify.set_defaults(run=run_verify, value_errors_are_usage=True)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="a folder with config.json and *.safetensors, a GGUF file or alias, or a cached HF repo id",
    )
    parser.add_argument("--reference", choices=("hf",), default="hf", help="what to compare against: hf (transformers)")
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help="one prompt per line; or JSON Lines (a .jsonl file, or one whose first line is JSON), each line a JSON "
        'string or {"prompt": ...}, for prompts of several lines (default: four built-in prompts)',
    )
    parser.add_argument("--dtype", help="weights and activations on both sides: float32 (default), float16 or bfloat16")
    parser.add_argument("--max-tokens", type=int, help="greedy tokens per prompt (default 16)")


def run_verify(args: argparse.Namespace) -> int:
    from weft.verify import DEFAULT_PROMPTS, read_prompts, verify

    prompts = read_prompts(args.prompts) if args.prompts else DEFAULT_PROMPTS
    given = {"dtype": args.dtype, "max_tokens": args.max_tokens}
    report = verify(args.model, prompts, reference=args.reference, **{k: v for k, v in given.items() if v is not None})
    print(report.table())
    failure = report.failure_message()
    if failure is not None:
        print(f"weft: verify: {failure}", file=sys.stderr)
        return 1
    return 0
