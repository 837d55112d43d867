"""Built-in model families."""
