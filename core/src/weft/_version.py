"""The weft-core release. Its major.minor is the plugin API version (CORE_API)."""

__version__ = "1.17.0"
