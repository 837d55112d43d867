"""Plugin discovery, compatibility checks, loading and the hook manager.

Discovery (:func:`discover`) reads entry-point metadata only. Loading
(:class:`PluginRegistry`) imports an implementation when it is selected, with
stevedore; hooks go through pluggy. :mod:`~weft.plugins.selection` turns
``[use]`` into plugins, :mod:`~weft.plugins.health` explains plugins that do not
import, and :mod:`~weft.plugins.lock` freezes the installed set and verifies it.
"""

from weft.plugins.discovery import PluginEntry, allowlist, discover
from weft.plugins.errors import PluginError
from weft.plugins.registry import PluginRegistry

__all__ = ["PluginEntry", "PluginError", "PluginRegistry", "allowlist", "discover"]
