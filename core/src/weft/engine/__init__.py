"""The engine: requests, scheduler, KV-cache manager, engine loop."""
