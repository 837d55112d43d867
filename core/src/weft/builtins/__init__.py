"""Core's built-in plugins. They register through entry points like any third-party plugin."""
