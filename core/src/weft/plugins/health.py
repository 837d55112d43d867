"""Import every enabled plugin and explain each that fails: the exception and the fix.

Discovery never imports a plugin, so a plugin whose import fails looks ``ok``
until something loads it. ``weft plugins doctor`` and ``weft plugins list
--check`` call :func:`load_failures` to find those, and say what to do about
each: install the missing module (naming the extra of the plugin's distribution
that requires it), install the missing system library, or reinstall the
distribution; and, for a distribution that brings its own platform which is not
available here, that its plugins are meant for that platform.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from typing import TYPE_CHECKING

import msgspec
from packaging.utils import canonicalize_name

from weft.plugins.discovery import PluginEntry, requirements
from weft.plugins.errors import PluginError

if TYPE_CHECKING:
    from packaging.requirements import Requirement

    from weft.contracts.platform import PlatformProbe
    from weft.plugins.registry import PluginRegistry


class LoadFailure(msgspec.Struct, frozen=True):
    """An enabled plugin whose implementation does not import."""

    entry: PluginEntry
    error: str
    """The exception, as ``Type: message``."""
    fix: str
    expected: bool
    """It comes with platforms of its own and none of them is the one running (harmless here)."""


def load_failures(
    registry: PluginRegistry, probes: dict[str, PlatformProbe], platform: str | None
) -> list[LoadFailure]:
    """Import every enabled (``ok``) plugin; one LoadFailure per plugin that fails.

    ``probes``: each importable platform's probe, for the fix of a plugin meant for an unavailable
    platform; ``platform``: the platform the configuration selects (None when none could be).
    """
    failures = []
    for entry in registry.entries:
        if entry.status != "ok":
            continue
        try:
            registry.load(entry.slot, entry.name)
        except PluginError as error:
            cause = error.__cause__ or error
            failures.append(
                LoadFailure(
                    entry=entry,
                    error=f"{type(cause).__name__}: {cause}",
                    fix=fix_for(entry, cause, registry.platforms_of(entry.distribution), probes),
                    expected=registry.meant_for_another_platform(entry, platform),
                )
            )
    return failures


def fix_for(entry: PluginEntry, error: BaseException, platforms: list[str], probes: dict[str, PlatformProbe]) -> str:
    """What to do about ``entry`` failing to import with ``error``."""
    fix = _fix_for_error(entry, error)
    unavailable = [name for name in platforms if name in probes and not probes[name].available]
    if unavailable and len(unavailable) == len(platforms):
        names = " or ".join(repr(name) for name in unavailable)
        reasons = "; ".join(probes[name].reason for name in unavailable)
        fix += f", or use {entry.distribution} on a machine where its platform {names} is available (here: {reasons})"
    return fix


def _fix_for_error(entry: PluginEntry, error: BaseException) -> str:
    reinstall = f"pip install --force-reinstall '{entry.distribution}=={entry.version}'"
    if isinstance(error, ModuleNotFoundError) and error.name:
        missing = error.name.split(".")[0]
        if missing == entry.module.split(".")[0]:
            return f"{entry.distribution}'s own module {entry.module!r} is missing: reinstall it ({reinstall})"
        requirement = _requirement_providing(entry.distribution, missing)
        if requirement is None:
            return (
                f"install the package that provides the module {missing!r} (a dependency {entry.distribution} does not "
                "declare)"
            )
        extra = _extra_of(requirement)
        if extra:
            return (
                f"install {missing} (pip install '{entry.distribution}[{extra}]' installs "
                f"{requirement.name}{requirement.specifier})"
            )
        return (
            f"install {missing} (pip install '{requirement.name}{requirement.specifier}', which {entry.distribution} "
            "requires)"
        )
    if isinstance(error, ImportError):
        library = re.search(r"(\S+\.so[.\d]*): cannot open shared object file", str(error))
        if library:
            return f"install the system library {library[1]} (your distribution's package that provides it)"
        return f"reinstall {entry.distribution} ({reinstall}) or the package its import names"
    if isinstance(error, AttributeError):
        return (
            f"{entry.distribution} {entry.version}'s entry point names {entry.target}, which its module does not "
            f"define: reinstall or upgrade {entry.distribution}"
        )
    return (
        f"importing {entry.module} raised an error: upgrade {entry.distribution} or report it to its authors; "
        f"pip uninstall {entry.distribution} removes it"
    )


def _requirement_providing(distribution: str, module: str) -> Requirement | None:
    """The requirement of ``distribution`` whose project is named like ``module`` (``triton`` -> ``triton>=3.3``)."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return None
    return next(
        (item for item in requirements(dist) if canonicalize_name(item.name) == canonicalize_name(module)), None
    )


def _extra_of(requirement: Requirement) -> str:
    """The extra a requirement belongs to (``extra == "kernels"`` in its marker), or ''."""
    match = re.search(r"""extra\s*==\s*["']([^"']+)["']""", str(requirement.marker or ""))
    return match[1] if match else ""
