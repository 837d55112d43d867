"""``weft serve [MODEL]``: the configured model over an OpenAI-compatible HTTP API (:mod:`weft.entrypoints.serve`).

Flags come in groups (model, plugins, engine, server), and vLLM's flags are taken too (:mod:`weft.cli.vllm_flags`);
the port is checked before anything loads.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from typing import Any

from weft.cli import vllm_flags
from weft.cli.options import add_config_arguments, config_from_args
from weft.config import ConfigError

EXAMPLES = """examples:
  weft serve                                         the default model (smollm2-135m-instruct) on 127.0.0.1:8000
  weft serve ./Llama-3.2-1B-Instruct --port 8800     a local folder (or a GGUF file, an alias, an HF repo id)
  weft serve org/name@main --api-key secret --max-num-seqs 16
  weft serve --config weft.toml --set plugins.mooncake.master_server_address=host:50051
  weft serve MODEL --strict-fields                   unknown request fields get a 400 instead of being ignored

then: curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hello"}]}'
"""


def add_parser(commands: Any) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the configured model over an OpenAI-compatible HTTP API",
        usage="%(prog)s [MODEL] [options]",
        description="Serve a model over an OpenAI-compatible HTTP API (chat completions, completions, responses).",
        epilog=EXAMPLES + "\n" + vllm_flags.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(serve, model_positional=True, aliases=vllm_flags.ALIASES)
    vllm_flags.add_arguments(serve)
    serve.set_defaults(run=run_serve, value_errors_are_usage=True, command_parser=serve)


def check_port_free(host: str, port: int) -> None:
    """A ConfigError naming the address when ``host:port`` cannot be bound (taken, or not this machine's), found
    as uvicorn binds (:meth:`uvicorn.Config.bind_socket`) but before the model loads. Port 0 (any free port)
    always can."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closing socket is no obstacle
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"server.port {port}: {host}:{port} is already in use (another server?); stop it, "
                    f"or pick a free port with --port"
                ) from None
            reason = error.strerror or str(error)
            raise ConfigError(
                f"server.host {host!r}, server.port {port}: cannot listen there ({reason}); "
                f"pick another address with --host or --port"
            ) from None


def run_serve(args: argparse.Namespace) -> int:
    notes = vllm_flags.apply(args)
    config, _ = config_from_args(args)
    from weft.distributed.placement import placement

    if placement(config).node_rank > 0:
        from weft.entrypoints.node import run_node

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        return run_node(config)
    check_port_free(config.server.host, config.server.port)  # before the model loads: a busy port fails at once
    for note in notes:
        print(f"weft: {note}", file=sys.stderr)
    from weft.engine.client import CoreStartError
    from weft.entrypoints.serve import serve

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
