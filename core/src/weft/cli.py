"""The ``weft`` command.

Core commands never load plugin implementations unless their job is to
(``plugins inspect``, ``plugins doctor``, ``plugins list --check``, ``config show``
with plugin tables); ``plugins list`` and ``plugins freeze`` read metadata only.
Commands contributed by plugins (the ``weft_cli_commands`` hook) are looked up
only when the first argument is not a core command.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from weft import __version__
from weft.config import ConfigError, EngineConfig, ServerConfig, UseConfig, WeftConfig, load_config, parse_override
from weft.plugins.errors import PluginError

CORE_COMMANDS = ("plugins", "config", "generate", "serve", "verify")
DEFAULT_CONFIG_FILE = "weft.toml"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_plugin_commands=_wants_plugin_commands(argv))
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ConfigError, PluginError) as error:
        print(f"weft: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        if args.run not in (run_generate, run_serve, run_verify):
            raise
        print(f"weft: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


def _wants_plugin_commands(argv: list[str]) -> bool:
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    if first is None:
        return any(arg in ("-h", "--help") for arg in argv)
    return first not in CORE_COMMANDS


def build_parser(with_plugin_commands: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description="Weft: plugin-architected LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"weft-core {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plugins = commands.add_parser("plugins", help="list, inspect and check installed plugins")
    plugin_commands = plugins.add_subparsers(title="plugins commands", metavar="COMMAND")
    listing = plugin_commands.add_parser("list", help="every installed plugin, from metadata only (imports nothing)")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "--check", action="store_true",
        help="also import every enabled plugin: one that fails is 'broken', with the exception and the fix; "
             "exits 1 when one of them could run on this machine (as doctor)",
    )
    listing.set_defaults(run=run_plugins_list)
    inspect = plugin_commands.add_parser("inspect", help="a plugin's details and option schema")
    inspect.add_argument("name", help="plugin name, or slot.name when several slots use the name")
    inspect.add_argument("--json", action="store_true", help="print JSON (the options as JSON Schema)")
    inspect.set_defaults(run=run_plugins_inspect)
    doctor = plugin_commands.add_parser(
        "doctor", help="load every selected plugin, probe platforms, import every enabled plugin, check the plugin lock"
    )
    add_config_arguments(doctor)
    doctor.set_defaults(run=run_plugins_doctor)
    freeze = plugin_commands.add_parser(
        "freeze", help="print the installed plugin set as a lock file: weft plugins freeze > weft.lock (imports nothing)"
    )
    freeze.set_defaults(run=run_plugins_freeze)

    config = commands.add_parser("config", help="show the effective configuration")
    config_commands = config.add_subparsers(title="config commands", metavar="COMMAND")
    show = config_commands.add_parser("show", help="the effective config, or its validation errors")
    add_config_arguments(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(run=run_config_show)

    serve = commands.add_parser("serve", help="serve the configured model over an OpenAI-compatible HTTP API")
    add_config_arguments(serve)
    serve.set_defaults(run=run_serve)

    generate = commands.add_parser("generate", help="generate text for prompts with the configured model")
    add_generate_arguments(generate)
    add_config_arguments(generate)
    generate.set_defaults(run=run_generate)

    verify = commands.add_parser("verify", help="check a model family token for token against its Hugging Face reference")
    add_verify_arguments(verify)
    verify.set_defaults(run=run_verify)

    if with_plugin_commands:
        _add_plugin_commands(commands)
    return parser


def _add_plugin_commands(commands: Any) -> None:
    from weft.plugins import PluginRegistry

    from weft.plugins.registry import warn_plugin_problem

    registry = PluginRegistry()
    taken = set(CORE_COMMANDS)
    for contributed in registry.hooks().hook.weft_cli_commands():
        for command in contributed or ():
            if command.name in taken:
                warn_plugin_problem(f"a plugin's command {command.name!r} is already taken; it is ignored")
                continue
            taken.add(command.name)
            sub = commands.add_parser(command.name, help=command.help)
            command.add_arguments(sub)
            sub.set_defaults(run=command.run)


# Configuration flags shared by every command that reads weft.toml.

_FLAG_SECTIONS: tuple[tuple[str, type[msgspec.Struct]], ...] = (
    ("use", UseConfig),
    ("engine", EngineConfig),
    ("server", ServerConfig),
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--model``, ``--set KEY=VALUE`` and one flag per scalar option of [use], [engine], [server]."""
    group = parser.add_argument_group("configuration (flags override the file)")
    group.add_argument("--config", metavar="FILE", help=f"config file (default: ./{DEFAULT_CONFIG_FILE} if present)")
    group.add_argument("--model", help="model alias, folder, GGUF file or HF repo id (org/name[@revision])")
    group.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
        help="set any key, e.g. --set plugins.mooncake.master_server_address=host:50051 (repeatable; VALUE is a TOML literal)",
    )
    for section, struct in _FLAG_SECTIONS:
        for path, field in _scalar_fields(section, struct):
            base, description = _unwrap(field.type)
            flag = "--" + field.name.replace("_", "-")
            dest = f"cfg:{path}"
            text = f"{path}: {description}" if description else path
            if base is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text)
            elif base is str:
                group.add_argument(flag, dest=dest, metavar=field.name.upper(), default=None, help=text, type=_Text)
            else:
                group.add_argument(flag, dest=dest, metavar=field.name.upper(), default=None, help=text)
        for path, field in _collection_fields(section, struct):
            base, description = _unwrap(field.type)
            flag = "--" + field.name.replace("_", "-")
            text = f"{path}: {description}" if description else path
            if base is list:  # --graph-batch-sizes 1,2,4,8 (one value: a prompt after it stays a prompt)
                group.add_argument(flag, dest=f"cfglist:{path}", metavar="N,N,...", default=None,
                                   help=f"{text} (comma-separated)")
            else:  # --ops rms_norm=torch --ops silu_and_mul=torch
                group.add_argument(flag, dest=f"cfgdict:{path}", metavar="KEY=VALUE", action="append", default=None,
                                   help=f"{text} (repeatable)")


def _collection_fields(section: str, struct: type[msgspec.Struct]) -> list[tuple[str, Any]]:
    """``(key path, field)`` of every list or table option of ``struct`` that takes scalars (``[plugins]`` is --set's)."""
    found = []
    for field in msgspec.structs.fields(struct):
        base, _ = _unwrap(field.type)
        if _is_struct(base):
            found.extend(_collection_fields(f"{section}.{field.name}", base))
        elif isinstance(base, type) and issubclass(base, (dict, list)):
            found.append((f"{section}.{field.name}", field))
    return found


def _scalar_fields(section: str, struct: type[msgspec.Struct]) -> list[tuple[str, Any]]:
    """``(key path, field)`` of every scalar option of ``struct``, nested tables' (``[engine.distributed]``) included."""
    found = []
    for field in msgspec.structs.fields(struct):
        base, _ = _unwrap(field.type)
        if _is_struct(base):
            found.extend(_scalar_fields(f"{section}.{field.name}", base))
        elif not (isinstance(base, type) and issubclass(base, (dict, list))):
            found.append((f"{section}.{field.name}", field))
    return found


class _Text(str):
    """A flag value kept as text (not read as a TOML literal): ``--api-key 12345`` is the string '12345'."""


def config_from_args(args: argparse.Namespace, registry: Any = None) -> tuple[WeftConfig, str | None]:
    """Load the configuration named by the arguments; returns it with the file it came from."""
    path = args.config
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    overrides: dict[str, Any] = {}
    if args.model is not None:
        overrides["model"] = args.model
    for name, value in vars(args).items():
        if name.startswith("cfg:") and value is not None:
            key = name[len("cfg:") :]
            overrides[key] = value if isinstance(value, bool) else str(value) if isinstance(value, _Text) else parse_override(f"{key}={value}")[1]
        elif name.startswith("cfglist:") and value is not None:
            items = [item.strip() for item in str(value).split(",") if item.strip()]
            overrides[name[len("cfglist:") :]] = [parse_override(f"item={item}")[1] for item in items]
        elif name.startswith("cfgdict:") and value is not None:
            key = name[len("cfgdict:") :]
            for assignment in value:  # one key each, added to the file's table
                entry, sep, text = assignment.partition("=")
                if not sep or not entry.strip():
                    raise ConfigError(f"--{key.rpartition('.')[2].replace('_', '-')} {assignment!r}: expected KEY=VALUE, "
                                      f"e.g. rms_norm=torch")
                overrides[f"{key}.{entry.strip()}"] = text.strip()
    for assignment in args.overrides:
        key, value = parse_override(assignment)
        overrides[key] = value
    return load_config(path, overrides, registry=registry), path


def _unwrap(annotation: Any) -> tuple[Any, str]:
    description = ""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            for meta in annotation.__metadata__:
                description = getattr(meta, "description", None) or description
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            annotation = members[0] if len(members) == 1 else annotation
            if len(members) != 1:
                return annotation, description
        else:
            return (origin or annotation), description


def _type_name(annotation: Any) -> str:
    base, _ = _unwrap(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) or "None" in repr(annotation):
        return f"{getattr(base, '__name__', repr(base))} | None"
    if typing.get_origin(base) is typing.Literal or base is typing.Literal:
        return " | ".join(repr(arg) for arg in typing.get_args(_unwrap_annotated(annotation)))
    return getattr(base, "__name__", repr(base))


def _unwrap_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


# plugins list / inspect / doctor


def run_plugins_list(args: argparse.Namespace) -> int:
    from weft.plugins import discover
    from weft.plugins.discovery import allowlist, unmatched_allowlist_names

    entries = discover()
    unmatched = unmatched_allowlist_names(entries, allowlist())
    problem = False
    if args.check:
        entries, problem = _mark_broken(entries)
    if args.json:
        rows = [
            {
                "name": entry.name,
                "slot": entry.slot,
                "distribution": entry.distribution,
                "version": entry.version,
                "core_api": entry.core_api,
                "builtin": entry.builtin,
                "target": entry.target,
                "status": entry.status,
                "problem": entry.problem,
            }
            for entry in entries
        ]
        sys.stdout.write(msgspec.json.encode({"plugins": rows, "unmatched_allowlist": unmatched}).decode() + "\n")
        return 1 if problem else 0
    header = ("SLOT", "NAME", "DISTRIBUTION", "VERSION", "CORE API", "STATUS")
    rows = [(e.slot, e.name, e.distribution, e.version, e.core_api or "-", e.status) for e in entries]
    _print_table(header, rows)
    for entry in entries:
        if entry.problem:
            print(f"\n{entry.slot}/{entry.name}: {entry.problem}")
    for name in unmatched:
        print(f"\nWEFT_PLUGINS names {name!r}, which matches no installed plugin or distribution")
    return 1 if problem else 0  # --check: a plugin that does not import, and would be usable here


def _mark_broken(entries: list[Any]) -> tuple[list[Any], bool]:
    """``entries`` with each enabled plugin that fails to import marked ``broken`` (the error and the fix), and
    whether one of them is a problem here (as doctor says: not one meant for a platform other than this one's)."""
    from weft.plugins import PluginError, PluginRegistry
    from weft.plugins.health import load_failures
    from weft.plugins.selection import probe_platforms, select_platform

    registry = PluginRegistry(entries)
    probes = {name: probe for name, (_, probe) in probe_platforms(registry).items()}
    try:
        platform: str | None = select_platform(registry, "auto")[0].name
    except PluginError:
        platform = None
    failures = load_failures(registry, probes, platform)
    broken = {(failure.entry.slot, failure.entry.name): failure for failure in failures}
    marked = [
        msgspec.structs.replace(entry, status="broken", problem=f"{failure.error}. Fix: {failure.fix}")
        if (failure := broken.get((entry.slot, entry.name))) else entry
        for entry in entries
    ]
    return marked, any(not failure.expected for failure in failures)


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


def run_plugins_inspect(args: argparse.Namespace) -> int:
    from weft.contracts.plugin import NoOptions
    from weft.plugins import PluginError, PluginRegistry

    registry = PluginRegistry()
    slot, _, name = args.name.partition(".") if args.name.split(".")[0] in _slots() else ("", "", args.name)
    matches = [entry for entry in registry.entries if entry.name == name and (not slot or entry.slot == slot)]
    if not matches:
        raise PluginError(f"no installed plugin is named {args.name!r}; see `weft plugins list`")
    if len(matches) > 1:
        choices = ", ".join(f"{entry.slot}.{entry.name}" for entry in matches)
        raise PluginError(f"several plugins are named {name!r}; inspect one of: {choices}")
    entry = matches[0]
    plugin = registry.load(entry.slot, entry.name)
    options = getattr(plugin, "Options", NoOptions)
    summary = plugin.summary() if hasattr(plugin, "summary") else (plugin.__doc__ or "").strip().split("\n")[0]
    if args.json:
        data = {
            "name": entry.name, "slot": entry.slot, "distribution": entry.distribution, "version": entry.version,
            "core_api": entry.core_api, "target": entry.target, "summary": summary,
            "options": msgspec.json.schema(options),
        }
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        return 0
    print(f"{entry.slot} plugin {entry.name!r}: {summary}")
    print(f"  distribution: {entry.distribution} {entry.version} (core API {entry.core_api or '-'})")
    print(f"  implementation: {entry.target}")
    fields = msgspec.structs.fields(options)
    if not fields:
        print("  options: none")
        return 0
    print(f"  options ([plugins.{entry.name}] in weft.toml):")
    rows = []
    for field in fields:
        _, description = _unwrap(field.type)
        default = "(required)" if field.required else repr(field.default if field.default is not msgspec.NODEFAULT else field.default_factory())
        rows.append(("   ", field.encode_name, _type_name(field.type), default, description))
    _print_table(("   ", "KEY", "TYPE", "DEFAULT", "DESCRIPTION"), rows)
    return 0


def _slots() -> tuple[str, ...]:
    from weft.contracts import SLOT_GROUPS

    return tuple(SLOT_GROUPS)


def run_plugins_doctor(args: argparse.Namespace) -> int:
    from weft.plugins import PluginError, PluginRegistry
    from weft.plugins.discovery import allowlist, unmatched_allowlist_names
    from weft.plugins.health import fix_for, load_failures
    from weft.plugins.lock import lock_path, verify_plugin_lock
    from weft.plugins.selection import plugins_named_in_use, probe_platforms, select_platform, use_label

    registry = PluginRegistry()
    failures: list[str] = []
    warnings: list[str] = []
    selected: set[tuple[str, str]] = set()
    probes: dict[str, Any] = {}

    def check(label: str, action: Any, plugin: tuple[str, str] | None = None) -> Any:
        """Run ``action``; a PluginError or ConfigError is a problem. ``plugin``: the (slot, name) it loads."""
        if plugin is not None:
            selected.add(plugin)
        try:
            result = action()
        except (PluginError, ConfigError) as error:
            failures.append(f"{label}: {error}")
            print(f"FAIL  {label}: {error}")
            if plugin is not None and error.__cause__ is not None:  # it was found, and failed to import
                entry = registry.find(*plugin)
                print(f"      fix: {fix_for(entry, error.__cause__, registry.platforms_of(entry.distribution), probes)}")
            return None
        print(f"ok    {label}")
        return result

    for entry in registry.entries:
        if entry.status == "conflict":
            failures.append(entry.problem)
            print(f"FAIL  {entry.slot}/{entry.name}: {entry.problem}")
        elif entry.status == "incompatible":
            warnings.append(entry.problem)
            print(f"warn  {entry.slot}/{entry.name}: {entry.problem}")
    for name in unmatched_allowlist_names(registry.entries, allowlist()):
        message = f"WEFT_PLUGINS names {name!r}, which matches no installed plugin or distribution"
        warnings.append(message)
        print(f"warn  {message}")

    loaded = check("config", lambda: config_from_args(args, registry))
    if loaded is None:
        return 1
    config, path = loaded
    print(f"      config file: {path or '(none: defaults)'}")
    named_lock = lock_path(config)
    if named_lock is not None:
        check("plugin lock", lambda: verify_plugin_lock(config))

    probes.update((name, probe) for name, (_, probe) in probe_platforms(registry).items())
    for name, probe in probes.items():
        state = "available" if probe.available else "unavailable"
        print(f"      platform {name}: {state}, priority {probe.priority}: {probe.reason}")
    use = config.use
    chosen = check(use_label("platform", use), lambda: select_platform(registry, use.platform),
                   None if use.platform == "auto" else ("platform", use.platform))
    platform_name = None
    if chosen is not None:
        platform, _ = chosen
        platform_name = platform.name
        print(f"      platform: {platform.name}")
        if use.attention == "auto":
            attention = platform.default_attention
            check(f"{use_label('attention', use)} -> {attention!r}", lambda: registry.load("attention", attention),
                  ("attention", attention))
    for key, slot, name in plugins_named_in_use(use):
        if slot != "platform":
            check(use_label(key, use), lambda slot=slot, name=name: registry.load(slot, name), (slot, name))
    for slot in ("loader", "tokenizer"):
        if getattr(use, slot) == "auto":
            print(f"      use.{slot} = 'auto': chosen from the model source when the model loads")
    check("hooks", lambda: print(f"      hooks plugins: {', '.join(sorted(n for n, _ in registry.hooks().list_name_plugin())) or 'none'}"))

    engine_starts = not failures
    # Every other enabled plugin: one that does not import is a problem unless it is meant for another platform.
    unselected = [failure for failure in load_failures(registry, probes, platform_name)
                  if (failure.entry.slot, failure.entry.name) not in selected]
    for failure in unselected:
        label = f"{failure.entry.slot}/{failure.entry.name} ({failure.entry.distribution} {failure.entry.version})"
        line = f"{label} does not import: {failure.error}"
        (warnings if failure.expected else failures).append(line)
        print(f"{'warn' if failure.expected else 'FAIL'}  {line}")
        print(f"      fix: {failure.fix}")
    if not unselected:
        print("ok    every enabled plugin imports")

    print()
    if failures:
        print(f"{len(failures)} problem(s) found{'' if engine_starts else '; the engine would not start'}.")
        return 1
    print(f"no problems found{f' ({len(warnings)} warning(s))' if warnings else ''}.")
    return 0


def run_plugins_freeze(args: argparse.Namespace) -> int:
    from weft.plugins.lock import freeze

    sys.stdout.write(freeze())
    return 0


GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}
"""``weft generate``'s own defaults where neither a flag nor the model's generation config sets a value."""


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    prompts.add_argument("prompt_args", nargs="*", metavar="PROMPT", help="prompts given as arguments")
    prompts.add_argument(
        "--prompts-file", metavar="FILE",
        help="one prompt per line; in a .jsonl file each line is {\"prompt\": ...} or {\"messages\": [...]}",
    )
    prompts.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="render prompts as a user message with the model's chat template (default: when it has one)",
    )
    sampling = parser.add_argument_group(
        "sampling", "an option left out takes the model's generation config (engine.generation_config), else its default"
    )
    sampling.add_argument("--max-tokens", type=int, help=f"most tokens per answer (default {GENERATE_DEFAULTS['max_tokens']})")
    sampling.add_argument("--temperature", type=float, help=f"0 is greedy (default {GENERATE_DEFAULTS['temperature']:g})")
    sampling.add_argument("--top-p", type=float, help="nucleus sampling; off unless set here or by the model")
    sampling.add_argument("--top-k", type=int, help="keep the k most likely tokens; off unless set here or by the model")
    sampling.add_argument("--min-p", type=float, help="drop tokens below min-p times the top one's probability; off unless set here or by the model")
    sampling.add_argument("--repetition-penalty", type=float, help="HF's repetition penalty; off unless set here or by the model")
    sampling.add_argument("--presence-penalty", type=float, default=0.0)
    sampling.add_argument("--frequency-penalty", type=float, default=0.0)
    sampling.add_argument("--sample-seed", type=int, default=None, help="seed of this run's sampling")
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--n", type=int, default=1, help="answers per prompt")
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token (with --json)")
    sampling.add_argument("--ignore-eos", action="store_true")
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


def run_generate(args: argparse.Namespace) -> int:
    from weft.entrypoints.llm import LLM
    from weft.sampling_params import SamplingParams

    prompts = _read_prompts(args)
    flags = {
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_tokens,
    }
    given = {field: value for field, value in flags.items() if value is not None}
    fixed = dict(
        n=args.n, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sample_seed, stop=tuple(args.stop), logprobs=args.logprobs, ignore_eos=args.ignore_eos,
    )
    try:  # the flags are checked before the model loads
        SamplingParams(**fixed, **given)
    except ValueError as error:
        raise ConfigError(str(error).replace("SamplingParams.", "--").replace("_", "-")) from None
    config, _ = config_from_args(args)
    llm = LLM(config=config)
    params = SamplingParams(**fixed, **{**GENERATE_DEFAULTS, **llm.model_sampling_defaults, **given})
    chat = args.chat if args.chat is not None else llm.tokenizer.has_chat_template
    if chat or any(not isinstance(prompt, str) for prompt in prompts):
        outputs = llm.chat([p if not isinstance(p, str) else [{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    results = []
    for prompt, output in zip(prompts, outputs):
        results.append(
            {
                "prompt": prompt,
                "prompt_token_ids": output.prompt_token_ids,
                "outputs": [
                    {
                        "text": completion.text,
                        "token_ids": completion.token_ids,
                        "finish_reason": completion.finish_reason,
                        **({"logprobs": [{str(k): v.logprob for k, v in step.items()} for step in completion.logprobs]}
                           if completion.logprobs is not None else {}),
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


def run_serve(args: argparse.Namespace) -> int:
    from weft.engine.async_engine import CoreStartError
    from weft.entrypoints.serve import serve

    config, _ = config_from_args(args)
    from weft.distributed.placement import placement

    if placement(config).node_rank > 0:
        from weft.entrypoints.node import run_node

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return run_node(config)
    try:
        status = serve(config)
    except CoreStartError as error:
        print(f"weft: error: {error}", file=sys.stderr)
        return 1
    # The server, the engine core and their sockets are closed: skip the interpreter's teardown (over a
    # second with torch loaded), so a shutdown ends within server.shutdown_timeout plus about a second.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_config_show(args: argparse.Namespace) -> int:
    from weft.config import to_builtins
    from weft.plugins import PluginRegistry
    from weft.plugins.selection import use_problems
    from weft.resolve import executor_problem, option_problems

    registry = PluginRegistry()
    config, path = config_from_args(args, registry)
    problems = use_problems(config.use, registry)
    if (problem := executor_problem(config.engine, registry)) is not None:
        problems.append(problem)
    if not problems:
        problems = option_problems(config, registry)
    for problem in problems:
        print(f"weft: error: {problem}", file=sys.stderr)
    if problems:
        return 1
    config, platform_note = _platform_sized(config, registry)
    data = to_builtins(config)
    option_types, unreadable = _plugin_option_types(registry)
    data["plugins"] = {
        **{name: msgspec.to_builtins(defaults) for name, (_, defaults) in option_types.items()},
        **data.get("plugins", {}),
    }
    if args.json:
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
        return 0
    print(f"# effective configuration (file: {path or 'none'}; flags override the file)")
    print(f"# {platform_note}")
    try:
        from weft.layers.quantization import quantization_notes

        print("\n".join(f"# {line}" for line in quantization_notes(config, registry)))
    except (ValueError, OSError) as error:
        print(f"# quantization: not resolved ({error})")
    descriptions = {name: options_type for name, (options_type, _) in option_types.items()}
    print("\n".join(_toml_lines(data, descriptions=descriptions)))
    for line in unreadable:
        print(f"# {line}")
    return 0


def _plugin_option_types(registry: Any) -> tuple[dict[str, tuple[type, Any]], list[str]]:
    """The options Struct and its defaults of every installed plugin that takes options, by the name of its
    ``[plugins.<name>]`` table (``slot.name`` where two plugins share a name); and a line for each plugin
    whose options cannot be read (it does not import, or an option has no default)."""
    from weft.contracts.plugin import NoOptions
    from weft.plugins import PluginError

    usable = [entry for entry in registry.entries if entry.status == "ok"]
    shared = {entry.name for entry in usable if sum(other.name == entry.name for other in usable) > 1}
    found: dict[str, tuple[type, Any]] = {}
    unreadable: list[str] = []
    for entry in sorted(usable, key=lambda entry: (entry.name, entry.slot)):
        table = f"{entry.slot}.{entry.name}" if entry.name in shared else entry.name
        try:
            options_type = getattr(registry.load(entry.slot, entry.name), "Options", NoOptions)
        except PluginError as error:
            unreadable.append(f"[plugins.{table}]: its options cannot be shown: {error} (see weft plugins doctor)")
            continue
        if options_type is NoOptions:
            continue
        try:
            found[table] = (options_type, msgspec.convert({}, options_type))
        except msgspec.ValidationError as error:
            unreadable.append(f"[plugins.{table}]: no defaults to show ({error}); set them in weft.toml")
    return found, unreadable


def _platform_sized(config: WeftConfig, registry: Any) -> tuple[WeftConfig, str]:
    """``config`` with the engine options the platform sizes filled in as the engine would, and a note
    saying where they came from (they stay unset when the platform cannot be built here)."""
    from weft.config import PLATFORM_SIZED
    from weft.resolve import build_platform, resolve_engine_config

    try:
        platform = build_platform(registry, config)
        return resolve_engine_config(config, registry, platform), f"engine defaults sized by platform {platform.name!r}"
    except Exception as error:  # noqa: BLE001 - the listing still helps without a usable platform
        return config, f"engine.{', engine.'.join(PLATFORM_SIZED)}: the platform's, which cannot be read here ({error})"


def _toml_lines(table: dict[str, Any], path: tuple[str, ...] = (), descriptions: dict[str, type] | None = None) -> list[str]:
    """``table`` as TOML; a key whose value is None (TOML has no null) is a comment saying it is unset
    (with its description: from WeftConfig, or for ``plugins.<name>.*`` from ``descriptions[name]``)."""
    lines = [f"[{'.'.join(map(_toml_key, path))}]"] if path else []
    for key, value in table.items():
        if value is None:
            description = _description((*path, key), descriptions or {})
            lines.append(f"# {_toml_key(key)}: unset{f' ({description})' if description else ''}")
        elif not isinstance(value, dict):
            lines += msgspec.toml.encode({key: value}).decode().splitlines()
    for key, value in table.items():
        if isinstance(value, dict):
            lines += ["", *_toml_lines(value, (*path, key), descriptions)]
    return lines


def _toml_key(key: str) -> str:
    return key if key and all(char.isascii() and (char.isalnum() or char in "-_") for char in key) else msgspec.json.encode(key).decode()


def _description(path: tuple[str, ...], plugin_options: dict[str, type]) -> str:
    """The description of the weft.toml key at ``path`` (a plugin's own option: from its options Struct)."""
    if path == ("plugins", "lock"):
        path = ("plugins_lock",)  # the field holding [plugins] lock (weft.config.to_builtins)
    struct: Any = WeftConfig
    if len(path) > 2 and path[0] == "plugins" and path[1] in plugin_options:
        struct, path = plugin_options[path[1]], path[2:]
    for part in path:
        fields = {field.encode_name: field for field in msgspec.structs.fields(struct)} if _is_struct(struct) else {}
        if part not in fields:
            return ""
        struct, description = _unwrap(fields[part].type)
    return description


def _is_struct(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, msgspec.Struct)


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="a folder with config.json and *.safetensors, a GGUF file or alias, or a cached HF repo id",
    )
    parser.add_argument("--reference", choices=("hf",), default="hf", help="what to compare against: hf (transformers)")
    parser.add_argument(
        "--prompts", metavar="FILE",
        help="one prompt per line; or JSON Lines (a .jsonl file, or one whose first line is JSON), each line a JSON "
             "string or {\"prompt\": ...}, for prompts of several lines (default: four built-in prompts)",
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


if __name__ == "__main__":
    sys.exit(main())
