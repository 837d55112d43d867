"""The engine core: scheduler, KV-cache manager, KV connector runtime, structured outputs, and its process."""
