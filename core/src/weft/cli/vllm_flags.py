"""vLLM's ``vllm serve`` flags that ``weft serve`` takes, so that a command line written for vLLM runs.

Weft's own flags already carry most of vLLM's names (``--port``, ``--max-model-len``, ``--tensor-parallel-size``,
``--enable-prefix-caching``...). The rest fall in three tables:

- :data:`ALIASES`: the same option under vLLM's name (``-tp``, ``--tool-call-parser``); listed in ``--help``
  beside Weft's name.
- :data:`NOTHING_TO_DO`: flags that have nothing to do in Weft (``--trust-remote-code``: Weft runs no code
  from a checkpoint); accepted, and a line at start-up says why nothing changes.
- :data:`NOT_IMPLEMENTED`: features Weft does not have (LoRA, data parallelism...); a value that would ask
  for one is an error naming the flag and what to do instead, its value that changes nothing (``--kv-cache-dtype
  auto``) is accepted.

:func:`add_arguments` adds the last two tables' flags to a parser (hidden from ``--help``, whose epilog names
them); :func:`apply` reads what was given, after parsing and before the configuration is loaded.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from weft.config import ConfigError

ALIASES: dict[str, tuple[str, ...]] = {
    "engine.tensor_parallel_size": ("-tp",),
    "engine.pipeline_parallel_size": ("-pp",),
    "engine.quantization": ("-q",),
    "engine.num_kv_blocks": ("--num-gpu-blocks-override",),
    "use.platform": ("--device",),
    "use.loader": ("--load-format",),
    "use.tool_parser": ("--tool-call-parser",),
    "use.structured_output": ("--guided-decoding-backend",),
}
"""vLLM's names of Weft's options (``add_config_arguments(aliases=...)``), by the option's key."""

DTYPE_SPELLINGS = {"half": "float16", "float": "float32"}
"""vLLM's other names of the dtypes ``engine.dtype`` takes."""
SIZE_SUFFIXES = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}
"""vLLM's suffixes of ``--max-model-len`` (``32k`` is 32,000 tokens, ``32K`` 32,768)."""


class VllmFlag(NamedTuple):
    """A flag of ``vllm serve``: its names, whether it takes a value, why Weft does nothing with it (or what to
    do instead) and, for one Weft does not implement, the value that asks for nothing (None: any use is refused)."""

    names: tuple[str, ...]
    why: str
    takes_value: bool = True
    accepted_value: str | None = None


NOTHING_TO_DO = (
    VllmFlag(
        ("--trust-remote-code",),
        "Weft runs no code from a checkpoint (its model families are its own, docs/models.md)",
        takes_value=False,
    ),
    VllmFlag(("--disable-log-requests",), "Weft logs no request's prompt or parameters", takes_value=False),
    VllmFlag(("--disable-log-stats",), "Weft logs no periodic statistics (GET /metrics has them)", takes_value=False),
    VllmFlag(
        ("--enable-auto-tool-choice",),
        "tool_choice 'auto' works whenever a tool parser is in use (--tool-parser; auto: the model's own)",
        takes_value=False,
    ),
    VllmFlag(
        ("--enable-prompt-tokens-details",),
        "usage always has prompt_tokens_details.cached_tokens",
        takes_value=False,
    ),
    VllmFlag(
        ("--swap-space",),
        "a preempted request's KV blocks are freed and recomputed, never swapped to the CPU",
    ),
    VllmFlag(
        ("-O", "--compilation-config"),
        "Weft compiles nothing with torch.compile (CUDA graphs: --graph-batch-sizes, off with --enforce-eager)",
    ),
)

NOT_IMPLEMENTED = (
    VllmFlag(
        ("--enable-lora",),
        "Weft serves no LoRA adapters; merge the adapter into the weights and serve those",
        takes_value=False,
    ),
    VllmFlag(("--lora-modules",), "Weft serves no LoRA adapters; merge the adapter into the weights and serve those"),
    VllmFlag(
        ("--cpu-offload-gb",), "Weft keeps all weights on the device; there is no CPU offload", accepted_value="0"
    ),
    VllmFlag(
        ("-dp", "--data-parallel-size"),
        "Weft has no data parallelism; run one weft serve per replica behind a load balancer",
        accepted_value="1",
    ),
    VllmFlag(("--chat-template",), "Weft renders chats with the model's own chat template"),
    VllmFlag(
        ("--kv-transfer-config",),
        "name the KV connector with --kv-connector and give its options as [plugins.NAME] (docs/disaggregation.md)",
    ),
    VllmFlag(
        ("--tokenizer-mode",),
        "Weft reads the tokenizer the model ships (its tokenizer.json, or the GGUF's vocabulary)",
        accepted_value="auto",
    ),
    VllmFlag(("--scheduling-policy",), "requests are scheduled first come, first served", accepted_value="fcfs"),
    VllmFlag(
        ("--override-generation-config",),
        "give a folder holding a generation_config.json with --generation-config FOLDER",
    ),
    VllmFlag(("--max-logprobs",), "at most 20 log-probabilities per token are returned", accepted_value="20"),
    VllmFlag(("--ssl-keyfile", "--ssl-certfile"), "Weft serves plain HTTP; terminate TLS in a proxy in front of it"),
    VllmFlag(
        ("--allowed-origins",),
        "Weft sends no CORS headers; put a proxy that adds them in front of it",
    ),
    VllmFlag(("--enable-sleep-mode",), "Weft cannot release the device's memory while serving", takes_value=False),
)

HF_TOKEN_FLAG = "--hf-token"
"""vLLM's ``--hf-token TOKEN``: the Hub token (Weft reads it as ``HF_TOKEN``, weft.hub)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :data:`NOTHING_TO_DO` and :data:`NOT_IMPLEMENTED`, and ``--hf-token``, hidden from ``--help``."""
    group = parser.add_argument_group("vLLM's flags")
    for flags, refused in ((NOTHING_TO_DO, False), (NOT_IMPLEMENTED, True)):
        for flag in flags:
            group.add_argument(
                *flag.names,
                dest="vllm_flags",
                action=_Given,
                nargs=None if flag.takes_value else 0,
                flag=flag,
                refused=refused,
                help=argparse.SUPPRESS,
            )
    group.add_argument(HF_TOKEN_FLAG, dest="hf_token", metavar="TOKEN", default=None, help=argparse.SUPPRESS)


def epilog() -> str:
    """The lines of ``--help`` that name vLLM's flags."""
    lines = {
        "the same options under vLLM's names (above)": [name for names in ALIASES.values() for name in names],
        "accepted, changing nothing (a start-up line says why)": [flag.names[-1] for flag in NOTHING_TO_DO],
        "refused, naming why (a value that changes nothing passes, e.g. --kv-cache-dtype auto)": [
            flag.names[-1] for flag in NOT_IMPLEMENTED
        ],
        "and": [
            "--dtype half|float",
            "--max-model-len 32k|32K",
            "--generation-config vllm",
            f"{HF_TOKEN_FLAG} TOKEN (sets HF_TOKEN)",
        ],
    }
    text = [
        textwrap.fill(
            f"{title}: {', '.join(flags)}", 110, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False
        )
        for title, flags in lines.items()
    ]
    return "vLLM's flags:\n" + "\n".join(text) + "\n"


class _Given(argparse.Action):
    """Records one of vLLM's flags given on the command line, or refuses it at once (a usage error naming it)."""

    def __init__(self, option_strings: list[str], dest: str, flag: VllmFlag, refused: bool, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, default=None, **kwargs)
        self.flag, self.refused = flag, refused

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        flag = self.flag
        given = f"{option_string} {values}" if flag.takes_value else str(option_string)
        if self.refused and (flag.accepted_value is None or str(values) != flag.accepted_value):
            kind = "does not implement" if flag.accepted_value is None else f"takes only as {flag.accepted_value}"
            parser.error(f"{given}: a flag of vLLM's that Weft {kind}: {flag.why}")
        recorded = list(getattr(namespace, self.dest, None) or [])
        if not self.refused:
            recorded.append(f"{given} (vLLM's flag) changes nothing here: {flag.why}")
        setattr(namespace, self.dest, recorded)


def apply(args: argparse.Namespace) -> list[str]:
    """Turns what vLLM's flags asked for into Weft's arguments (in ``args``, before the configuration is loaded);
    returns the lines to show at start-up. ``--hf-token`` sets ``HF_TOKEN`` for this process and the engine's.
    A ConfigError names a flag whose value means something else in Weft (``--tokenizer`` with vLLM's path)."""
    notes = list(getattr(args, "vllm_flags", None) or [])
    dtype = getattr(args, "cfg:engine.dtype", None)
    if dtype in DTYPE_SPELLINGS:
        setattr(args, "cfg:engine.dtype", type(dtype)(DTYPE_SPELLINGS[dtype]))
        notes.append(f"--dtype {dtype} (vLLM's spelling) is {DTYPE_SPELLINGS[dtype]}")
    length = getattr(args, "cfg:engine.max_model_len", None)
    sized = re.fullmatch(r"(\d+(?:\.\d+)?)([kmKM])", str(length)) if length is not None else None
    if sized is not None:
        tokens = int(float(sized[1]) * SIZE_SUFFIXES[sized[2]])
        setattr(args, "cfg:engine.max_model_len", str(tokens))
        notes.append(f"--max-model-len {length} (vLLM's spelling) is {tokens:,} tokens")
    generation_config = getattr(args, "cfg:engine.generation_config", None)
    if generation_config == "vllm":
        setattr(args, "cfg:engine.generation_config", type(generation_config)("none"))
        notes.append("--generation-config vllm (vLLM's spelling) is none: Weft's defaults, not the model's")
    tokenizer = getattr(args, "cfg:use.tokenizer", None)
    if tokenizer is not None and ("/" in tokenizer or os.sep in tokenizer or Path(tokenizer).exists()):
        raise ConfigError(
            f"--tokenizer {tokenizer!r}: Weft's --tokenizer names a tokenizer plugin (use.tokenizer: auto, or one "
            f"that weft plugins list shows), not a path or repo as vLLM's; Weft reads the tokenizer of the model "
            f"(MODEL's folder, repo or GGUF file): leave --tokenizer out"
        )
    if getattr(args, "hf_token", None):
        os.environ["HF_TOKEN"] = args.hf_token
    return notes
