"""The configuration flags shared by every command that reads ``weft.toml``, and the configuration they name.

One flag per scalar, list or table option of ``[use]``, ``[engine]`` and ``[server]``, generated from the
schema (:mod:`weft.config.schema`: its descriptions are the help), in one argument group per table, so a
new option is a new flag with nothing to write here. Plugins' commands use the same two functions
(:func:`add_config_arguments`, :func:`config_from_args`).
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from weft.config import ConfigError, EngineConfig, ServerConfig, UseConfig, WeftConfig, load_config, parse_override

DEFAULT_CONFIG_FILE = "weft.toml"

FLAG_SECTIONS: dict[str, tuple[type[msgspec.Struct], str]] = {
    "use": (UseConfig, "plugins ([use]: which plugin fills each slot)"),
    "engine": (EngineConfig, "engine ([engine])"),
    "server": (ServerConfig, "server ([server])"),
}
"""The tables with a flag per option: the struct, and the title of its argument group in ``--help``."""


def add_config_arguments(
    parser: argparse.ArgumentParser, sections: tuple[str, ...] = tuple(FLAG_SECTIONS), model_positional: bool = False
) -> None:
    """``--config``, ``--model``, ``--set KEY=VALUE`` and one flag per option of each table of ``sections``
    (an argument group each). ``model_positional``: the model may also be given as the first argument
    (``weft serve MODEL``, as vLLM's)."""
    group = parser.add_argument_group("model and configuration (flags override the file)")
    if model_positional:
        group.add_argument(
            "model_positional",
            nargs="?",
            metavar="MODEL",
            default=None,
            help="the model, as --model (give one of the two)",
        )
    group.add_argument("--model", help="model alias, folder, GGUF file or HF repo id (org/name[@revision])")
    group.add_argument("--config", metavar="FILE", help=f"config file (default: ./{DEFAULT_CONFIG_FILE} if present)")
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="set any key, e.g. --set plugins.mooncake.master_server_address=host:50051 (repeatable; VALUE is a "
        "TOML literal)",
    )
    for section in sections:
        struct, title = FLAG_SECTIONS[section]
        _add_section_flags(parser.add_argument_group(title), section, struct)


SPECULATIVE_TABLE = "engine.speculative"
"""Set by ``--speculative-config JSON`` (vLLM's flag), not by a flag per option: its ``model`` and ``method``
would read as the engine's own."""


def _add_section_flags(group: Any, section: str, struct: type[msgspec.Struct]) -> None:
    if section == "engine":
        group.add_argument(
            "--speculative-config",
            dest="speculative_config",
            metavar="JSON",
            default=None,
            help=f"{SPECULATIVE_TABLE}: speculative decoding as a JSON object, as vLLM's flag, e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
        )
    for path, field in _scalar_fields(section, struct):
        if path.startswith(SPECULATIVE_TABLE + "."):
            continue
        base, description = unwrap(field.type)
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
        if path.startswith(SPECULATIVE_TABLE + "."):
            continue
        base, description = unwrap(field.type)
        flag = "--" + field.name.replace("_", "-")
        text = f"{path}: {description}" if description else path
        if base is list:  # --graph-batch-sizes 1,2,4,8 (one value: a prompt after it stays a prompt)
            group.add_argument(
                flag, dest=f"cfglist:{path}", metavar="N,N,...", default=None, help=f"{text} (comma-separated)"
            )
        else:  # --ops rms_norm=torch --ops silu_and_mul=torch
            group.add_argument(
                flag,
                dest=f"cfgdict:{path}",
                metavar="KEY=VALUE",
                action="append",
                default=None,
                help=f"{text} (repeatable)",
            )


def _collection_fields(section: str, struct: type[msgspec.Struct]) -> list[tuple[str, Any]]:
    """``(key path, field)`` of every list or table option of ``struct`` that takes scalars (``[plugins]`` is
    --set's)."""
    found = []
    for field in msgspec.structs.fields(struct):
        base, _ = unwrap(field.type)
        if is_struct(base):
            found.extend(_collection_fields(f"{section}.{field.name}", base))
        elif isinstance(base, type) and issubclass(base, (dict, list)):
            found.append((f"{section}.{field.name}", field))
    return found


def _scalar_fields(section: str, struct: type[msgspec.Struct]) -> list[tuple[str, Any]]:
    """``(key path, field)`` of every scalar option of ``struct``, nested tables' (``[engine.distributed]``)
    included."""
    found = []
    for field in msgspec.structs.fields(struct):
        base, _ = unwrap(field.type)
        if is_struct(base):
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
    model = _model_argument(args)
    if model is not None:
        overrides["model"] = model
    for name, value in vars(args).items():
        if name.startswith("cfg:") and value is not None:
            key = name[len("cfg:") :]
            overrides[key] = (
                value
                if isinstance(value, bool)
                else str(value)
                if isinstance(value, _Text)
                else parse_override(f"{key}={value}")[1]
            )
        elif name.startswith("cfglist:") and value is not None:
            items = [item.strip() for item in str(value).split(",") if item.strip()]
            overrides[name[len("cfglist:") :]] = [parse_override(f"item={item}")[1] for item in items]
        elif name.startswith("cfgdict:") and value is not None:
            key = name[len("cfgdict:") :]
            for assignment in value:  # one key each, added to the file's table
                entry, sep, text = assignment.partition("=")
                if not sep or not entry.strip():
                    raise ConfigError(
                        f"--{key.rpartition('.')[2].replace('_', '-')} {assignment!r}: expected KEY=VALUE, "
                        f"e.g. rms_norm=torch"
                    )
                overrides[f"{key}.{entry.strip()}"] = text.strip()
    overrides.update(_speculative_overrides(getattr(args, "speculative_config", None)))
    for assignment in args.overrides:
        key, value = parse_override(assignment)
        overrides[key] = value
    return load_config(path, overrides, registry=registry), path


def _speculative_overrides(text: str | None) -> dict[str, Any]:
    """``--speculative-config``'s JSON object as ``engine.speculative.KEY`` overrides (vLLM's spelling of the
    method ``"[ngram]"`` is not needed: the keys are those of ``[engine.speculative]``)."""
    if text is None:
        return {}
    try:
        table = msgspec.json.decode(text)
    except msgspec.DecodeError as error:
        raise ConfigError(
            f"--speculative-config {text!r}: not JSON ({error}); give an object such as "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\''
        ) from None
    if not isinstance(table, dict):
        raise ConfigError(
            f"--speculative-config {text!r}: expected a JSON object of [engine.speculative] keys, got "
            f"{type(table).__name__}"
        )
    return {f"{SPECULATIVE_TABLE}.{key}": value for key, value in table.items()}


def _model_argument(args: argparse.Namespace) -> str | None:
    """The model named by ``MODEL`` or ``--model`` (both is an error unless they agree)."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ConfigError(
            f"the model is given twice, as MODEL {positional!r} and as --model {args.model!r}; give one of them"
        )
    return positional if positional is not None else args.model


def unwrap(annotation: Any) -> tuple[Any, str]:
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


def type_name(annotation: Any) -> str:
    base, _ = unwrap(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) or "None" in repr(annotation):
        return f"{getattr(base, '__name__', repr(base))} | None"
    if typing.get_origin(base) is typing.Literal or base is typing.Literal:
        return " | ".join(repr(arg) for arg in typing.get_args(_without_annotated(annotation)))
    return getattr(base, "__name__", repr(base))


def _without_annotated(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def is_struct(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, msgspec.Struct)
