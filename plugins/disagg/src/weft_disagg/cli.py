"""``weft proxy pd``: the P/D proxy as a command (contributed through ``weft_cli_commands``)."""

from __future__ import annotations

import argparse
from typing import Any

from weft.contracts.hooks import CliCommand, hookimpl


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="proxy_kind", required=True, metavar="KIND")
    pd = kinds.add_parser(
        "pd", help="prefill/decode disaggregation: prefill legs and decode legs to separate instances"
    )
    _add_common_arguments(pd)
    epd = kinds.add_parser(
        "epd",
        help="encode/prefill/decode disaggregation: images to encode instances first, then prefill and decode legs",
    )
    epd.add_argument(
        "--encode",
        nargs="+",
        required=True,
        metavar="URL",
        help="encode instances (weft serve with engine.encoder_store, the folder the prefill instances read)",
    )
    _add_common_arguments(epd)


def _add_common_arguments(pd: argparse.ArgumentParser) -> None:
    pd.add_argument(
        "--prefill",
        nargs="+",
        default=[],
        metavar="URL",
        help="prefill instances (weft serve with plugins.nixl.role = 'kv_producer'); none: the decode instances "
        "prefill",
    )
    pd.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode instances (weft serve with plugins.nixl.role = 'kv_consumer')",
    )
    pd.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    pd.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    pd.add_argument(
        "--policy",
        choices=["round_robin", "least_loaded"],
        default="round_robin",
        help="how an instance is chosen among the healthy ones (default round_robin)",
    )
    pd.add_argument(
        "--decode-attempts",
        type=int,
        default=2,
        metavar="N",
        help="decode attempts per request: a 5xx before the first byte is retried (default 2)",
    )
    pd.add_argument(
        "--health-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how often instances' /health is checked (default 2)",
    )
    pd.add_argument(
        "--leg-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="longest an instance may send nothing on a leg (no headers, no next byte); then the leg fails: a "
        "decode leg before its first byte is a 502, a prefill leg leaves the decode instance to compute the prompt, "
        "counted in weft_proxy_leg_failures_total (default 1800, the instances' server.request_timeout)",
    )
    pd.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from weft_disagg.epd import EPDProxy
    from weft_disagg.pd import PDProxy, create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = (args.policy, args.decode_attempts, args.health_interval, args.leg_timeout)
    try:
        if args.proxy_kind == "epd":
            proxy: PDProxy = EPDProxy(args.encode, args.prefill, args.decode, *settings)
        else:
            proxy = PDProxy(args.prefill, args.decode, *settings)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    uvicorn.run(create_app(proxy), host=args.host, port=args.port, log_level=args.log_level)
    return 0


@hookimpl
def weft_cli_commands() -> list[Any]:
    return [
        CliCommand(
            name="proxy",
            help="run a disaggregation proxy (weft proxy pd ...: prefill/decode; weft proxy epd ...: images first)",
            add_arguments=add_arguments,
            run=run,
        )
    ]
