"""The pytest plugin of the conformance kit (entry point ``pytest11: weft``). Imports no torch."""

from __future__ import annotations

import pytest


@pytest.fixture
def weft_registry():
    """A fresh :class:`weft.plugins.PluginRegistry` of the plugins installed in this environment."""
    from weft.plugins import PluginRegistry

    return PluginRegistry()
