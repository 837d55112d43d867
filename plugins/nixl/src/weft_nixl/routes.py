"""``GET /kv_transfer``: where a P/D proxy reaches this instance's NIXL side channel.

Registered through ``weft_http_routes`` (entry point ``weft.hooks``). A server whose
``use.kv_connector`` is not ``nixl`` answers 404, so installing weft-nixl changes no
other server.
"""

from __future__ import annotations

from typing import Any

from weft.contracts.hooks import hookimpl


async def kv_transfer(request: Any) -> Any:
    from starlette.responses import JSONResponse
    from weft.config import plugin_options

    from weft_nixl.connector import NixlOptions

    config = request.app.state.server.config
    if config.use.kv_connector != "nixl":
        return JSONResponse({"error": {"message": "this server's use.kv_connector is not 'nixl'", "type": "not_found_error",
                                       "code": "404"}}, status_code=404)
    options = plugin_options(config, NixlOptions, "kv_connector", "nixl")
    return JSONResponse({
        "kv_connector": "nixl", "role": options.role,
        "side_channel_host": options.side_channel_host, "side_channel_port": options.side_channel_port,
        "tensor_parallel_size": config.engine.tensor_parallel_size,
    })


@hookimpl
def weft_http_routes() -> list[Any]:
    from starlette.routing import Route

    return [Route("/kv_transfer", kv_transfer, methods=["GET"])]
