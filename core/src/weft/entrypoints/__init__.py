"""User-facing entry points: the Python LLM class (the server arrives with its issue)."""
