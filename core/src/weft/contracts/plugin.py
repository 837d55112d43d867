"""What every slot's plugin class has in common: a description and typed options.

A plugin's options are a frozen msgspec Struct that the plugin class names as
``Options``. The user sets them in ``weft.toml`` under ``[plugins.<name>]``;
core validates that table against the Struct when the configuration loads and
hands the plugin the resulting instance. Document each field with a
``msgspec.Meta(description=...)`` annotation: ``weft plugins inspect NAME``
prints the schema, the defaults and those descriptions.

Example::

    class MooncakeOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        master_server_address: Annotated[str, msgspec.Meta(description="host:port of mooncake_master")]
        global_segment_size: int = 0

    class MooncakeConnector(KVConnector):
        Options = MooncakeOptions
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class NoOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The options of a plugin that takes none: an empty table."""


class PluginBase:
    """Base of every slot's contract class."""

    Options: ClassVar[type[msgspec.Struct]] = NoOptions
    """The msgspec Struct validating this plugin's ``[plugins.<name>]`` table."""

    description: ClassVar[str] = ""
    """One line shown by ``weft plugins inspect``; defaults to the class docstring's first line."""

    @classmethod
    def summary(cls) -> str:
        if cls.description:
            return cls.description
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""
