"""weft-disagg: the prefill/decode disaggregation proxy.

``pd`` holds the proxy (a Starlette app; its legs on aiohttp), ``cli`` the
``weft proxy pd`` command (contributed through the ``weft_cli_commands`` hook),
``fake_upstream`` an upstream that streams fixed bytes, for measuring the proxy's
own overhead and checking its byte pass-through. Importing this package imports
neither torch nor the engine.
"""
