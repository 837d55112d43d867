"""The hooks slot: 1:N events every enabled plugin may take part in (pluggy).

A plugin registers a module (or object) under the ``weft.hooks`` entry-point
group and decorates functions with :data:`hookimpl`; function names match the
specs below. An implementation may accept fewer arguments than its spec, so
specs can grow without breaking plugins. Hook calls are logged with
``WEFT_TRACE_PLUGINS=1``.

Example::

    from weft.contracts.hooks import hookimpl

    @hookimpl
    def weft_request_finished(request_id, finish_reason):
        print(request_id, finish_reason)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import pluggy

if TYPE_CHECKING:
    from weft.config import WeftConfig

PROJECT = "weft"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def weft_configure(config: WeftConfig) -> None:
    """Called once the configuration is loaded and validated, before any plugin is built.

    ``config`` is frozen: read it, don't change it. Raise to refuse the
    configuration; the error is shown to the user.
    """


@hookspec
def weft_engine_started(engine: Any) -> None:
    """Called once the engine has loaded the model and is ready for requests."""


@hookspec
def weft_request_finished(request_id: str, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
    """Called when a request ends (``finish_reason``: ``stop``, ``length``, ``abort``, ``error``).

    Runs on the engine's thread: keep it short.
    """


@hookspec
def weft_http_routes() -> list[Any]:
    """Return starlette routes (``starlette.routing.Route`` or ``Mount``) to add to the server.

    Called when the server app is built; paths must not collide with core's.
    """


@hookspec
def weft_cli_commands() -> list[CliCommand]:
    """Return extra ``weft`` sub-commands.

    Called only when the first argument of ``weft`` is not a core command (or
    for ``weft --help``), so listing plugins never imports hook plugins.
    """


class CliCommand(msgspec.Struct, frozen=True):
    """A sub-command contributed through :func:`weft_cli_commands`."""

    name: str
    """The sub-command: ``weft <name>``."""
    help: str
    """One line for ``weft --help``."""
    add_arguments: Any
    """``add_arguments(parser: argparse.ArgumentParser) -> None``."""
    run: Any
    """``run(args: argparse.Namespace) -> int``: the exit status."""
