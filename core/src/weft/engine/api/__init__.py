"""The API side of the engine (no torch): frontend, output processing, ``LLM``'s engine and the async engine."""
