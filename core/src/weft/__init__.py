"""Weft: a plugin-architected LLM inference and serving framework.

Importing ``weft`` is cheap: it pulls in neither torch nor any plugin.
"""

from weft._version import __version__
from weft.contracts import CORE_API

__all__ = ["CORE_API", "__version__"]
