"""The error type every plugin problem is reported with."""


class PluginError(Exception):
    """A plugin cannot be found, is incompatible, clashes with another, or failed to load."""
