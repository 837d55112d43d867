"""The ``weft`` command: one module per command group, each adding its parser and running it.

- :mod:`weft.cli.serve`: ``weft serve``; :mod:`weft.cli.generate`: ``weft generate``;
  :mod:`weft.cli.verify`: ``weft verify``; :mod:`weft.cli.plugins`: ``weft plugins list|inspect|doctor|freeze``;
  :mod:`weft.cli.config`: ``weft config show``.
- :mod:`weft.cli.options`: the configuration flags they share (plugins' commands use them too:
  :func:`add_config_arguments`, :func:`config_from_args`, re-exported here).

Core commands never load plugin implementations unless their job is to
(``plugins inspect``, ``plugins doctor``, ``plugins list --check``, ``config show``
with plugin tables); ``plugins list`` and ``plugins freeze`` read metadata only.
Commands contributed by plugins (the ``weft_cli_commands`` hook) are looked up
only when the first argument is not a core command.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any

from weft import __version__
from weft.cli import config, generate, plugins, serve, verify
from weft.cli.options import DEFAULT_CONFIG_FILE, add_config_arguments, config_from_args
from weft.config import ConfigError
from weft.plugins.errors import PluginError

__all__ = ["CORE_COMMANDS", "DEFAULT_CONFIG_FILE", "add_config_arguments", "build_parser", "config_from_args", "main"]

CORE_COMMANDS = ("plugins", "config", "generate", "serve", "verify")
_COMMAND_MODULES = (plugins, config, serve, generate, verify)  # the order of `weft --help`


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(with_plugin_commands=_wants_plugin_commands(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, "command_parser", parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{_closest_flags(command, unknown)}")
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return int(args.run(args) or 0)
    except (ConfigError, PluginError) as error:
        print(f"weft: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        if not getattr(args, "value_errors_are_usage", False):  # a bug elsewhere keeps its traceback
            raise
        print(f"weft: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


def _closest_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What a mistyped or foreign flag may have meant (``--modle``: ``--model``), and where the flags are listed."""
    flags = [flag for action in parser._actions for flag in action.option_strings]
    guesses = [
        f"; {given}: did you mean {close[0]}?"
        for given in unknown
        if given.startswith("-") and (close := difflib.get_close_matches(given.partition("=")[0], flags, n=1))
    ]
    return f"{''.join(guesses)} ({parser.prog} --help lists its flags)"


def _wants_plugin_commands(argv: list[str]) -> bool:
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    if first is None:
        return any(arg in ("-h", "--help") for arg in argv)
    return first not in CORE_COMMANDS


def build_parser(with_plugin_commands: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weft", description="Weft: plugin-architected LLM inference and serving.")
    parser.add_argument("--version", action="version", version=f"weft-core {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in _COMMAND_MODULES:
        module.add_parser(commands)
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
