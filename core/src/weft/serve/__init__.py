"""The OpenAI-compatible HTTP server: starlette app, msgspec protocol Structs, SSE."""
