"""Weft: a plugin-architected LLM inference and serving framework.

Importing ``weft`` is cheap: it pulls in neither torch nor any plugin. ``LLM``
and ``SamplingParams`` load on first use.
"""

from typing import Any

from weft._version import __version__
from weft.contracts import CORE_API

__all__ = ["CORE_API", "LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from weft.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from weft.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'weft' has no attribute {name!r}")
