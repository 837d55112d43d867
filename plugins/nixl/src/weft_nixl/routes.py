"""``GET /kv_transfer``: where a P/D proxy reaches this instance's NIXL side channel;
``POST /kv_transfer/abandon`` ``{"transfer_id": T}``: a prefill leg that failed before the engine
saw it (a refusal, a full queue) ends its transfer, so the decode instance computes the prompt at
once instead of at its ``transfer_timeout``.

Registered through ``weft_http_routes`` (entry point ``weft.hooks``). A server whose
``use.kv_connector`` is not ``nixl`` answers 404, so installing weft-nixl changes no
other server.
"""

from __future__ import annotations

from typing import Any

from weft.contracts.hooks import hookimpl


def _options(request: Any) -> Any:
    """This server's nixl options, or None when it does not use weft-nixl."""
    from weft.api import plugin_options
    from weft_nixl.connector import NixlOptions

    config = request.app.state.server.config
    if config.use.kv_connector != "nixl":
        return None
    return plugin_options(config, NixlOptions, "kv_connector", "nixl")


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": str(status)}}, status_code=status)


async def kv_transfer(request: Any) -> Any:
    from starlette.responses import JSONResponse

    options = _options(request)
    if options is None:
        return _error(404, "this server's use.kv_connector is not 'nixl'")
    config = request.app.state.server.config
    return JSONResponse(
        {
            "kv_connector": "nixl",
            "role": options.role,
            "side_channel_host": options.side_channel_host,
            "side_channel_port": options.side_channel_port,
            "tensor_parallel_size": config.engine.tensor_parallel_size,
        }
    )


async def abandon(request: Any) -> Any:
    import msgspec
    import zmq
    import zmq.asyncio
    from starlette.responses import JSONResponse

    from weft_nixl.side_channel import Abandon, encode

    options = _options(request)
    if options is None:
        return _error(404, "this server's use.kv_connector is not 'nixl'")
    server = request.app.state.server
    if server.api_key is not None and request.headers.get("authorization", "") != f"Bearer {server.api_key}":
        return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
    try:
        transfer_id = msgspec.json.decode(await request.body()).get("transfer_id")
    except (msgspec.DecodeError, AttributeError):
        transfer_id = None
    if not isinstance(transfer_id, str):
        return _error(400, 'send {"transfer_id": "<the transfer id of the failed prefill leg>"}')
    host = "127.0.0.1" if options.side_channel_host in ("0.0.0.0", "::") else options.side_channel_host
    context = zmq.asyncio.Context.instance()
    for rank in range(request.app.state.server.config.engine.tensor_parallel_size):
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.connect(f"tcp://{host}:{options.side_channel_port + rank}")
        await socket.send(encode(Abandon(transfer_id)))
        socket.close()
    return JSONResponse({"abandoned": transfer_id})


@hookimpl
def weft_http_routes() -> list[Any]:
    from starlette.routing import Route

    return [
        Route("/kv_transfer", kv_transfer, methods=["GET"]),
        Route("/kv_transfer/abandon", abandon, methods=["POST"]),
    ]
