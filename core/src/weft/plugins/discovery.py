"""Find every plugin from entry-point metadata alone: nothing is imported here.

Each entry point becomes a :class:`PluginEntry` with its slot, name,
distribution, the core API range that distribution declares (its requirement
on ``weft-core``) and a status:

``ok``            loadable;
``incompatible``  its declared range excludes this core's :data:`~weft.contracts.CORE_API`;
``conflict``      another enabled distribution registers the same name in the same slot;
``disabled``      excluded by the ``WEFT_PLUGINS`` allowlist.

(``weft plugins list --check`` imports the ``ok`` ones and marks each that fails
``broken``, with the exception and the fix: see :mod:`weft.plugins.health`.)

``WEFT_PLUGINS`` lists distribution names, plugin names or ``slot.name``
pairs separated by commas; ``none`` disables every plugin outside weft-core.
Core's own entries are always enabled, and a listed distribution brings the
plugin distributions it requires (``weft-cuda`` brings ``weft-triton``'s kernels).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
from collections import defaultdict
from collections.abc import Iterator

import msgspec
from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from weft._version import __version__ as CORE_VERSION
from weft.contracts import CORE_API, SLOT_GROUPS

CORE_DISTRIBUTION = "weft-core"
CORE_API_TEXT = f"{CORE_API[0]}.{CORE_API[1]}"


class PluginEntry(msgspec.Struct, frozen=True):
    """One registered plugin, as its distribution's metadata describes it."""

    slot: str
    name: str
    target: str
    """The entry point's ``module:attribute``; imported only when loaded."""
    distribution: str
    version: str
    core_api: str
    """The ``weft-core`` range the distribution declares (``>=1.0,<2``); empty if none.

    Core's own entries carry ``==<CORE_API>``."""
    builtin: bool
    status: str = "ok"
    problem: str = ""

    @property
    def module(self) -> str:
        return self.target.partition(":")[0].strip()

    def describe(self) -> str:
        return f"plugin {self.name!r} ({self.distribution} {self.version})"


class Allowlist(msgspec.Struct, frozen=True):
    """The parsed ``WEFT_PLUGINS`` variable; ``names is None`` means everything is allowed."""

    names: frozenset[str] | None
    raw: str = ""

    def allows(self, entry: PluginEntry) -> bool:
        if entry.builtin or self.names is None:
            return True
        keys = {canonicalize_name(entry.distribution), entry.name, f"{entry.slot}.{entry.name}"}
        return bool(keys & self.names)


def allowlist() -> Allowlist:
    raw = os.environ.get("WEFT_PLUGINS")
    if raw is None or not raw.strip():
        return Allowlist(names=None)
    items = {item.strip() for item in raw.split(",") if item.strip()}
    if {item.lower() for item in items} == {"none"}:
        return Allowlist(names=frozenset(), raw=raw)
    return Allowlist(names=frozenset(items | {canonicalize_name(item) for item in items}), raw=raw)


def with_required_distributions(allowed: Allowlist, dists: dict[str, metadata.Distribution]) -> Allowlist:
    """``allowed`` plus the plugin distributions (of ``dists``, by canonical name) that a listed one requires."""
    if not allowed.names:
        return allowed
    environment = {**default_environment(), "extra": ""}
    names = set(allowed.names)
    pending = [name for name in dists if name in names]
    while pending:
        for requirement in requirements(dists[pending.pop()]):
            required = canonicalize_name(requirement.name)
            if required in dists and required not in names:
                if requirement.marker is None or requirement.marker.evaluate(environment):
                    names.add(required)
                    pending.append(required)
    return msgspec.structs.replace(allowed, names=frozenset(names))


def unmatched_allowlist_names(entries: list[PluginEntry], allowed: Allowlist) -> list[str]:
    """Names in ``WEFT_PLUGINS`` that match no installed plugin (typos, uninstalled plugins)."""
    if not allowed.names:
        return []
    known: set[str] = set()
    for entry in entries:
        known |= {canonicalize_name(entry.distribution), entry.name, f"{entry.slot}.{entry.name}"}
    requested = [item.strip() for item in allowed.raw.split(",") if item.strip()]
    return [item for item in requested if item not in known and canonicalize_name(item) not in known]


def requirements(dist: metadata.Distribution) -> Iterator[Requirement]:
    """``dist``'s declared requirements (``Requires-Dist``), extras and markers included; unparsable ones skipped."""
    for line in dist.requires or ():
        try:
            yield Requirement(line)
        except InvalidRequirement:
            continue


def declared_core_api(dist: metadata.Distribution) -> str:
    """The specifier of ``dist``'s unconditional requirement on weft-core ('' if none)."""
    environment = {**default_environment(), "extra": ""}
    for requirement in requirements(dist):
        if canonicalize_name(requirement.name) != CORE_DISTRIBUTION:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        return ",".join(sorted((str(item) for item in requirement.specifier), key=lambda item: (item[0] != ">", item)))
    return ""


def compatibility_problem(entry: PluginEntry) -> str:
    """Why ``entry`` cannot run with this core, or '' if it can."""
    if entry.builtin:
        return ""
    if not entry.core_api:
        return (
            f"{entry.describe()} declares no weft-core API range; installed core API is {CORE_API_TEXT}. Its "
            f"distribution must depend on weft-core with a range, e.g. 'weft-core>={CORE_API_TEXT},<{CORE_API[0] + 1}'"
        )
    from packaging.specifiers import SpecifierSet

    if not SpecifierSet(entry.core_api).contains(CORE_VERSION, prereleases=True):
        return (
            f"{entry.describe()} requires weft-core API {entry.core_api}; installed core API is {CORE_API_TEXT} "
            f"(weft-core {CORE_VERSION}). Install a release of {entry.distribution} built for weft-core "
            f"{CORE_API_TEXT}, or a weft-core in {entry.core_api}"
        )
    return ""


def discover() -> list[PluginEntry]:
    """Every plugin entry point of every slot, with its status. Imports nothing."""
    entries: list[PluginEntry] = []
    installed = metadata.entry_points()  # one scan of the installed distributions for every group
    plugin_dists = {
        canonicalize_name(ep.dist.metadata["Name"]): ep.dist
        for group in SLOT_GROUPS.values()
        for ep in installed.select(group=group)
        if ep.dist is not None
    }
    allowed = with_required_distributions(allowlist(), plugin_dists)
    for slot, group in SLOT_GROUPS.items():
        for ep in installed.select(group=group):
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "<unknown>"
            builtin = canonicalize_name(dist_name) == CORE_DISTRIBUTION
            entry = PluginEntry(
                slot=slot,
                name=ep.name,
                target=ep.value,
                distribution=dist_name,
                version=dist.version if dist is not None else "?",
                core_api=f"=={CORE_API_TEXT}" if builtin else declared_core_api(dist) if dist is not None else "",
                builtin=builtin,
            )
            if not allowed.allows(entry):
                entry = msgspec.structs.replace(
                    entry, status="disabled", problem=f"excluded by WEFT_PLUGINS={allowed.raw!r}"
                )
            elif problem := compatibility_problem(entry):
                entry = msgspec.structs.replace(entry, status="incompatible", problem=problem)
            entries.append(entry)
    slot_order = list(SLOT_GROUPS)
    entries.sort(key=lambda entry: (slot_order.index(entry.slot), not entry.builtin, entry.name, entry.distribution))
    return _mark_conflicts(entries)


def _mark_conflicts(entries: list[PluginEntry]) -> list[PluginEntry]:
    by_key: dict[tuple[str, str], list[int]] = defaultdict(list)
    for index, entry in enumerate(entries):
        if entry.status != "disabled":
            by_key[(entry.slot, entry.name)].append(index)
    for (slot, name), indices in by_key.items():
        if len(indices) < 2:
            continue
        owners = " and ".join(f"{entries[i].distribution} {entries[i].version}" for i in indices)
        problem = (
            f"{slot} plugin name {name!r} is registered by {owners}; names must be unique per slot. "
            f"Uninstall one, or exclude one with WEFT_PLUGINS"
        )
        for i in indices:
            entries[i] = msgspec.structs.replace(entries[i], status="conflict", problem=problem)
    return entries
