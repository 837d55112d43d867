"""``weft plugins list|inspect|doctor|freeze``: the installed plugins, from metadata (list, freeze) or loaded
(inspect, doctor, list --check)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from weft.cli.options import add_config_arguments, config_from_args, type_name, unwrap
from weft.config import ConfigError


def add_parser(commands: Any) -> None:
    plugins = commands.add_parser("plugins", help="list, inspect and check installed plugins")
    plugin_commands = plugins.add_subparsers(title="plugins commands", metavar="COMMAND")
    listing = plugin_commands.add_parser("list", help="every installed plugin, from metadata only (imports nothing)")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.add_argument(
        "--check",
        action="store_true",
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
        "freeze",
        help="print the installed plugin set as a lock file: weft plugins freeze > weft.lock (imports nothing)",
    )
    freeze.set_defaults(run=run_plugins_freeze)


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
        if (failure := broken.get((entry.slot, entry.name)))
        else entry
        for entry in entries
    ]
    return marked, any(not failure.expected for failure in failures)


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip())


def run_plugins_inspect(args: argparse.Namespace) -> int:
    from weft.config import plugin_table
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
            "name": entry.name,
            "slot": entry.slot,
            "distribution": entry.distribution,
            "version": entry.version,
            "core_api": entry.core_api,
            "target": entry.target,
            "summary": summary,
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
    print(f"  options ({plugin_table(entry, registry.entries)} in weft.toml):")
    rows = []
    for field in fields:
        _, description = unwrap(field.type)
        default = (
            "(required)"
            if field.required
            else repr(field.default if field.default is not msgspec.NODEFAULT else field.default_factory())
        )
        rows.append(("   ", field.encode_name, type_name(field.type), default, description))
    _print_table(("   ", "KEY", "TYPE", "DEFAULT", "DESCRIPTION"), rows)
    return 0


def _slots() -> tuple[str, ...]:
    from weft.contracts import SLOT_GROUPS

    return tuple(SLOT_GROUPS)


def run_plugins_doctor(args: argparse.Namespace) -> int:
    from weft.plugins import PluginError, PluginRegistry
    from weft.plugins.health import fix_for
    from weft.plugins.lock import lock_path, verify_plugin_lock

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
                print(
                    f"      fix: {fix_for(entry, error.__cause__, registry.platforms_of(entry.distribution), probes)}"
                )
            return None
        print(f"ok    {label}")
        return result

    _check_discovery(registry, failures, warnings)
    loaded = check("config", lambda: config_from_args(args, registry))
    if loaded is None:
        return 1
    config, path = loaded
    print(f"      config file: {path or '(none: defaults)'}")
    named_lock = lock_path(config)
    if named_lock is not None:
        check("plugin lock", lambda: verify_plugin_lock(config))

    platform_name = _check_selection(registry, config.use, probes, check)

    engine_starts = not failures
    _check_unselected(registry, probes, platform_name, selected, failures, warnings)
    print()
    if failures:
        print(f"{len(failures)} problem(s) found{'' if engine_starts else '; the engine would not start'}.")
        return 1
    print(f"no problems found{f' ({len(warnings)} warning(s))' if warnings else ''}.")
    return 0


def _check_selection(registry: Any, use: Any, probes: dict[str, Any], check: Callable[..., Any]) -> str | None:
    """The platforms' probes (recorded in ``probes``), then the platform, attention backend, named plugins and hooks
    that ``use`` selects, each loaded through ``check``; the chosen platform's name (None: none could be chosen)."""
    from weft.plugins.selection import plugins_named_in_use, probe_platforms, select_platform, use_label

    probes.update((name, probe) for name, (_, probe) in probe_platforms(registry).items())
    for name, probe in probes.items():
        state = "available" if probe.available else "unavailable"
        print(f"      platform {name}: {state}, priority {probe.priority}: {probe.reason}")
    chosen = check(
        use_label("platform", use),
        lambda: select_platform(registry, use.platform),
        None if use.platform == "auto" else ("platform", use.platform),
    )
    platform_name = None
    if chosen is not None:
        platform, _ = chosen
        platform_name = platform.name
        print(f"      platform: {platform.name}")
        if use.attention == "auto":
            attention = platform.default_attention
            check(
                f"{use_label('attention', use)} -> {attention!r}",
                lambda: registry.load("attention", attention),
                ("attention", attention),
            )
    for key, slot, name in plugins_named_in_use(use):
        if slot != "platform":
            check(use_label(key, use), lambda slot=slot, name=name: registry.load(slot, name), (slot, name))
    for slot in ("loader", "tokenizer"):
        if getattr(use, slot) == "auto":
            print(f"      use.{slot} = 'auto': chosen from the model source when the model loads")
    check(
        "hooks",
        lambda: print(
            f"      hooks plugins: {', '.join(sorted(n for n, _ in registry.hooks().list_name_plugin())) or 'none'}"
        ),
    )
    return platform_name


def _check_discovery(registry: Any, failures: list[str], warnings: list[str]) -> None:
    """Name clashes (failures), plugins for another core API and WEFT_PLUGINS names matching nothing (warnings)."""
    from weft.plugins.discovery import allowlist, unmatched_allowlist_names

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


def _check_unselected(
    registry: Any,
    probes: dict[str, Any],
    platform_name: str | None,
    selected: set[tuple[str, str]],
    failures: list[str],
    warnings: list[str],
) -> None:
    """Doctor's last check: every enabled plugin the configuration did not select. One that does not import is a
    problem (added to ``failures``) unless it is meant for another platform (a warning)."""
    from weft.plugins.health import load_failures

    unselected = [
        failure
        for failure in load_failures(registry, probes, platform_name)
        if (failure.entry.slot, failure.entry.name) not in selected
    ]
    for failure in unselected:
        label = f"{failure.entry.slot}/{failure.entry.name} ({failure.entry.distribution} {failure.entry.version})"
        line = f"{label} does not import: {failure.error}"
        (warnings if failure.expected else failures).append(line)
        print(f"{'warn' if failure.expected else 'FAIL'}  {line}")
        print(f"      fix: {failure.fix}")
    if not unselected:
        print("ok    every enabled plugin imports")


def run_plugins_freeze(args: argparse.Namespace) -> int:
    from weft.plugins.lock import freeze

    sys.stdout.write(freeze())
    return 0
