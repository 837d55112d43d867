"""``weft config show``: the effective configuration as TOML (or JSON), every option with its value or "unset",
the engine options the platform sizes filled in, and each installed plugin's options with their defaults."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from weft.cli.options import add_config_arguments, config_from_args, is_struct, unwrap
from weft.config import WeftConfig


def add_parser(commands: Any) -> None:
    config = commands.add_parser("config", help="show the effective configuration")
    config_commands = config.add_subparsers(title="config commands", metavar="COMMAND")
    show = config_commands.add_parser("show", help="the effective config, or its validation errors")
    add_config_arguments(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(run=run_config_show)


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
    from weft.config import plugin_table, plugin_table_key
    from weft.contracts.plugin import NoOptions
    from weft.plugins import PluginError

    usable = [entry for entry in registry.entries if entry.status == "ok"]
    found: dict[str, tuple[type, Any]] = {}
    unreadable: list[str] = []
    loaded = []
    for entry in sorted(usable, key=lambda entry: (entry.name, entry.slot)):
        table = plugin_table(entry, registry.entries)  # a broken plugin of the same name shares a bare table
        try:
            options_type = getattr(registry.load(entry.slot, entry.name), "Options", NoOptions)
        except PluginError as error:
            unreadable.append(f"{table}: its options cannot be shown: {error} (see weft plugins doctor)")
            continue
        loaded.append((entry, table, options_type))
    for entry, table, options_type in loaded:
        if options_type is NoOptions:
            continue
        # Plugins of several slots that share a name and one Options Struct (weft-mooncake's KV and encoder
        # connectors) read one [plugins.<name>] table: it is shown once.
        namesakes = {other_type for other, _, other_type in loaded if other.name == entry.name}
        key = entry.name if namesakes == {options_type} else plugin_table_key(entry, registry.entries)
        try:
            found[key] = (options_type, msgspec.convert({}, options_type))
        except msgspec.ValidationError as error:
            unreadable.append(f"{table}: no defaults to show ({error}); set them in weft.toml")
    return found, unreadable


def _platform_sized(config: WeftConfig, registry: Any) -> tuple[WeftConfig, str]:
    """``config`` with the engine options the platform sizes filled in as the engine would, and a note
    saying where they came from (they stay unset when the platform cannot be built here); on the CPU, a second
    line: its GEMM instruction sets and the GEMM dtype."""
    from weft.config import PLATFORM_SIZED
    from weft.resolve import build_platform, resolve_engine_config

    try:
        platform = build_platform(registry, config)
        note = f"engine defaults sized by platform {platform.name!r}"
        if platform.device_type == "cpu":
            from weft.engine.core.builder import cpu_isa_line

            note += f"\n# CPU: {cpu_isa_line()}"
        return resolve_engine_config(config, registry, platform), note
    except Exception as error:  # noqa: BLE001 - the listing still helps without a usable platform
        return config, f"engine.{', engine.'.join(PLATFORM_SIZED)}: the platform's, which cannot be read here ({error})"


def _toml_lines(
    table: dict[str, Any], path: tuple[str, ...] = (), descriptions: dict[str, type] | None = None
) -> list[str]:
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
    return (
        key
        if key and all(char.isascii() and (char.isalnum() or char in "-_") for char in key)
        else msgspec.json.encode(key).decode()
    )


def _description(path: tuple[str, ...], plugin_options: dict[str, type]) -> str:
    """The description of the weft.toml key at ``path`` (a plugin's own option: from its options Struct)."""
    if path == ("plugins", "lock"):
        path = ("plugins_lock",)  # the field holding [plugins] lock (weft.config.to_builtins)
    struct: Any = WeftConfig
    if len(path) > 2 and path[0] == "plugins" and path[1] in plugin_options:
        struct, path = plugin_options[path[1]], path[2:]
    for part in path:
        fields = {field.encode_name: field for field in msgspec.structs.fields(struct)} if is_struct(struct) else {}
        if part not in fields:
            return ""
        struct, description = unwrap(fields[part].type)
    return description
