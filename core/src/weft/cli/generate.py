"""``weft generate``: text for prompts with the configured model, in this process (no server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from weft.cli.options import add_config_arguments, config_from_args
from weft.config import ConfigError

EXAMPLES = """examples:
  weft generate "Once upon a time"                   the default model, its chat template if it has one
  weft generate --model ./my-model --no-chat --max-tokens 32 "def fib(n):"
  weft generate --prompts-file prompts.jsonl --json --temperature 0.7 --sample-seed 1
  weft generate --model ./llava --image cat.png "What is in the picture?"
"""


def add_parser(commands: Any) -> None:
    generate = commands.add_parser(
        "generate",
        help="generate text for prompts with the configured model",
        usage="%(prog)s [PROMPT ...] [options]",
        description="Generate text for prompts with the configured model, in this process (no server).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_generate_arguments(generate)
    add_config_arguments(generate, sections=("use", "engine"))  # no server: its flags would do nothing here
    generate.set_defaults(run=run_generate, value_errors_are_usage=True, command_parser=generate)


GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
"""``weft generate``'s own defaults where neither a flag nor the model's generation config sets a value."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    prompts.add_argument("prompt_args", nargs="*", metavar="PROMPT", help="prompts given as arguments")
    prompts.add_argument(
        "--prompts-file",
        metavar="FILE",
        help='one prompt per line; in a .jsonl file each line is {"prompt": ...} or {"messages": [...]}',
    )
    prompts.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render prompts as a user message with the model's chat template (default: when it has one)",
    )
    prompts.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file each prompt shows the model before its text (repeatable; a vision-language model, chat)",
    )
    sampling = parser.add_argument_group(
        "sampling",
        "an option left out takes the model's generation config (engine.generation_config), else its default",
    )
    sampling.add_argument(
        "--max-tokens", type=int, help=f"most tokens per answer (default {GENERATE_DEFAULTS['max_tokens']})"
    )
    sampling.add_argument(
        "--temperature", type=float, help=f"0 is greedy (default {GENERATE_DEFAULTS['temperature']:g})"
    )
    sampling.add_argument("--top-p", type=float, help="nucleus sampling; off unless set here or by the model")
    sampling.add_argument(
        "--top-k", type=int, help="keep the k most likely tokens; off unless set here or by the model"
    )
    sampling.add_argument(
        "--min-p",
        type=float,
        help="drop tokens below min-p times the top one's probability; off unless set here or by the model",
    )
    sampling.add_argument(
        "--repetition-penalty", type=float, help="HF's repetition penalty; off unless set here or by the model"
    )
    sampling.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from the logit of each token already in the answer (default 0)",
    )
    sampling.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted from a token's logit once per time it is already in the answer (default 0)",
    )
    sampling.add_argument(
        "--sample-seed",
        type=int,
        default=None,
        help="this run's own sampling seed (an API request's 'seed'): each answer is reproducible whatever else runs "
        "beside it; --seed (engine.seed) only seeds the generator shared by requests that give no seed",
    )
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--n", type=int, default=1, help="answers per prompt")
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token (with --json)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    parser.add_argument("--json", action="store_true", help="print JSON: text, token ids and finish reason per prompt")


def _read_prompts(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = [*args.prompt, *args.prompt_args]
    if args.prompts_file:
        path = Path(args.prompts_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as error:
            raise ConfigError(f"--prompts-file {path}: {error.strerror}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    item = msgspec.json.decode(line)
                except msgspec.DecodeError as error:
                    raise ConfigError(f"{path}:{number}: not valid JSON: {error}") from None
                if not isinstance(item, dict) or not ({"prompt", "messages"} & set(item)):
                    raise ConfigError(f"{path}:{number}: expected an object with 'prompt' or 'messages'")
                prompts.append(item.get("messages") or item["prompt"])
            else:
                prompts.append(line)
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT, prompts as arguments, or --prompts-file FILE")
    return prompts


def _image_url(path: str) -> str:
    """A ``file:`` URL of an ``--image`` file (checked here, before the model loads)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ConfigError(f"--image {path}: no such file")
    return resolved.as_uri()


def _user_message(prompt: Any, images: list[str]) -> Any:
    """A text prompt as a conversation of one user message: the ``--image`` files first, then the text. A prompt
    that is already a conversation (a ``messages`` line of ``--prompts-file``) is kept as it is."""
    if not isinstance(prompt, str):
        return prompt
    if not images:
        return [{"role": "user", "content": prompt}]
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": prompt}]}]


def run_generate(args: argparse.Namespace) -> int:
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    images = [_image_url(path) for path in args.image]
    flags = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "max_tokens": args.max_tokens,
    }
    given = {field: value for field, value in flags.items() if value is not None}
    fixed = dict(
        n=args.n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sample_seed,
        stop=tuple(args.stop),
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    try:  # the flags are checked before the model loads
        SamplingParams(**fixed, **given)
    except ValueError as error:
        raise ConfigError(str(error).replace("SamplingParams.", "--").replace("_", "-")) from None
    config, _ = config_from_args(args)
    llm = LLM(config=config)
    params = SamplingParams(**fixed, **{**GENERATE_DEFAULTS, **llm.model_sampling_defaults, **given})
    chat = args.chat if args.chat is not None else llm.tokenizer.has_chat_template
    if images and not chat:
        raise ConfigError(
            "--image needs the chat template (each prompt becomes a user message with the images): drop --no-chat"
        )
    if chat or any(not isinstance(prompt, str) for prompt in prompts):
        outputs = llm.chat([_user_message(prompt, images) for prompt in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    results = []
    for prompt, output in zip(prompts, outputs, strict=False):
        results.append(
            {
                "prompt": prompt,
                "prompt_token_ids": output.prompt_token_ids,
                "outputs": [
                    {
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                        **(
                            {"logprobs": [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs]}
                            if completion.logprobs is not None
                            else {}
                        ),
                    }
                    for completion in output.outputs
                ],
            }
        )
    if args.json:
        sys.stdout.write(msgspec.json.encode(results).decode() + "\n")
        return 0
    for index, result in enumerate(results):
        if len(results) > 1:
            print(f"--- prompt {index + 1}: {result['prompt'] if isinstance(result['prompt'], str) else '(messages)'}")
        for completion in result["outputs"]:
            print(completion["text"])
    return 0
