"""The plugin lock: the exact installed plugin set, frozen to a file and checked at every engine start.

``weft plugins freeze > weft.lock`` writes, as TOML, every distribution that
registers a Weft entry point (weft-core included): its name and version, the
weft-core range it declares, a SHA-256 of its ``RECORD`` (so a rebuild under the
same version shows), and its entry points with their targets. Discovery's
metadata is all it reads: nothing is imported.

The RECORD hash identifies the build's content, not the installation: it covers
each ``path,hash`` entry of RECORD, sorted, except the lines without a hash
(RECORD itself, bytecode compiled at install time), the files the installer adds
to the ``.dist-info`` folder (``INSTALLER``, ``REQUESTED``, ``direct_url.json``:
which tool, whether asked for directly, from which URL or checkout) and the files
installed outside the package folder (console scripts in the environment's
``bin/``, whose first line names that environment's Python). The same wheel
installed from another checkout, by another installer, or as a dependency
hashes the same.

When ``[plugins] lock`` in weft.toml (relative to that file) or the
``WEFT_PLUGINS_LOCK`` variable names a lock, :func:`verify_plugin_lock` refuses
a start whose installed set differs, naming each difference: a distribution
upgraded, downgraded, rebuilt, added or removed, a declared weft-core range
changed, an entry point added, removed or pointing elsewhere.

It runs before the model or any plugin the engine selects loads (only the
plugins of a weft.toml's ``[plugins.<name>]`` tables are imported earlier, to
read the configuration), in every process that starts an engine or its workers
from its own installation: ``EngineCore`` (``LLM``, ``weft generate``, the core
process of ``weft serve``), ``AsyncEngine`` (``weft serve``'s API process,
before it resolves the model), the launcher of each node other than node 0
(:func:`weft.entrypoints.node.run_node`), and each Ray actor of weft-ray
(:func:`verify_installed`, against the lock the engine read: the actor may run
on a machine without the file). The ``mp`` executor's worker processes are
spawned from the interpreter of a launcher that checked, so they do not check
again. ``weft plugins doctor`` runs the same check.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata as metadata
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from weft.plugins.discovery import PluginEntry, discover
from weft.plugins.errors import PluginError

if TYPE_CHECKING:
    from weft.config import WeftConfig

LOCK_VARIABLE = "WEFT_PLUGINS_LOCK"
LOCK_FORMAT = 2
"""The version of the lock file's layout; a lock of another layout is refused (1: RECORD hashed whole)."""
INSTALLER_FILES = ("INSTALLER", "REQUESTED", "direct_url.json")
"""What the installer adds to a ``.dist-info`` folder (PEP 376, PEP 610): how a build was installed, not what it is."""


class LockedEntryPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    slot: str
    name: str
    target: str


class LockedDistribution(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    version: str
    core_api: str
    """The weft-core range the distribution declares ('' if none)."""
    record_sha256: str
    """SHA-256 of the build's entries in RECORD (the module docstring says which); '' without a RECORD."""
    entry_points: list[LockedEntryPoint]


class PluginLock(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lock_format: int
    distributions: list[LockedDistribution]


class NamedLock(msgspec.Struct, frozen=True):
    """A lock read from the file the configuration names, with where it was named (a refusal cites both)."""

    path: str
    source: str
    lock: PluginLock


def installed_plugin_set(entries: list[PluginEntry] | None = None) -> PluginLock:
    """The lock describing what is installed now (``entries``: discovery's, by default)."""
    by_distribution: dict[str, list[PluginEntry]] = defaultdict(list)
    for entry in discover() if entries is None else entries:
        by_distribution[entry.distribution].append(entry)
    distributions = []
    for name, dist_entries in sorted(by_distribution.items(), key=lambda item: canonicalize_name(item[0])):
        first = dist_entries[0]
        distributions.append(
            LockedDistribution(
                name=name,
                version=first.version,
                core_api=first.core_api,
                record_sha256=_record_sha256(name),
                entry_points=sorted(
                    (LockedEntryPoint(slot=entry.slot, name=entry.name, target=entry.target) for entry in dist_entries),
                    key=lambda point: (point.slot, point.name),
                ),
            )
        )
    return PluginLock(lock_format=LOCK_FORMAT, distributions=distributions)


def freeze() -> str:
    """The installed plugin set as the text of a lock file."""
    header = (
        "# The installed Weft plugin set, written by `weft plugins freeze`. An engine start refuses a different\n"
        f"# set when weft.toml's [plugins] lock or {LOCK_VARIABLE} names this file.\n"
    )
    return header + msgspec.toml.encode(installed_plugin_set()).decode()


def read_lock(path: str | Path) -> PluginLock:
    """The lock in ``path``; a PluginError naming the file when it cannot be read or is not a lock."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise PluginError(
            f"plugin lock {path}: cannot read it ({error.strerror}); write it with `weft plugins freeze > {path}`"
        ) from None
    try:
        lock = msgspec.toml.decode(data, type=PluginLock)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise PluginError(f"plugin lock {path}: not a lock written by `weft plugins freeze`: {error}") from None
    if lock.lock_format != LOCK_FORMAT:
        raise PluginError(
            f"plugin lock {path}: lock_format {lock.lock_format}, this weft-core reads {LOCK_FORMAT}; "
            f"write it again with `weft plugins freeze > {path}`"
        )
    return lock


def lock_differences(locked: PluginLock, installed: PluginLock) -> list[str]:
    """Each way ``installed`` differs from ``locked``, one sentence each (empty when they match)."""
    was = {canonicalize_name(dist.name): dist for dist in locked.distributions}
    now = {canonicalize_name(dist.name): dist for dist in installed.distributions}
    differences = []
    for key in sorted(was.keys() | now.keys()):
        before, after = was.get(key), now.get(key)
        if after is None:
            differences.append(f"{before.name} {before.version} removed: locked, but not installed")
        elif before is None:
            differences.append(f"{after.name} {after.version} added: installed, but not in the lock")
        else:
            differences += _distribution_differences(before, after)
    return differences


def lock_path(config: WeftConfig) -> tuple[str, str] | None:
    """The lock to verify against and where it was named, or None when none is."""
    if config.plugins_lock:
        return config.plugins_lock, "[plugins] lock in the configuration"
    if os.environ.get(LOCK_VARIABLE):
        return os.environ[LOCK_VARIABLE], LOCK_VARIABLE
    return None


def configured_lock(config: WeftConfig) -> NamedLock | None:
    """The lock the configuration (or ``WEFT_PLUGINS_LOCK``) names, read; None when none is named."""
    named = lock_path(config)
    if named is None:
        return None
    path, source = named
    return NamedLock(path=path, source=source, lock=read_lock(path))


def verify_installed(named: NamedLock, where: str = "") -> None:
    """Refuse (PluginError) when this interpreter's installed set differs from ``named``'s lock.

    ``where``: words placing this process, for a refusal read elsewhere (`` on host-3 (Ray worker rank 2)``).
    """
    differences = lock_differences(named.lock, installed_plugin_set())
    if differences:
        listed = "".join(f"\n  - {difference}" for difference in differences)
        raise PluginError(
            f"the installed plugins{where} differ from the lock {named.path} (named by {named.source}):{listed}\n"
            f"Install the locked set, or accept the installed one with `weft plugins freeze > {named.path}`"
        )


def verify_plugin_lock(config: WeftConfig) -> None:
    """Refuse (PluginError) when the configuration names a plugin lock and the installed set differs from it."""
    named = configured_lock(config)
    if named is not None:
        verify_installed(named)


def _distribution_differences(before: LockedDistribution, after: LockedDistribution) -> list[str]:
    name = after.name
    differences = []
    if before.version != after.version:
        differences.append(
            f"{name} {_direction(before.version, after.version)}: locked {before.version}, installed {after.version}"
        )
    else:
        if before.record_sha256 != after.record_sha256:
            differences.append(
                f"{name} {after.version} reinstalled from a different build: its RECORD hash is "
                f"{after.record_sha256[:16] or 'absent'}, locked {before.record_sha256[:16] or 'absent'}"
            )
        if before.core_api != after.core_api:
            differences.append(
                f"{name} {after.version} declares weft-core {after.core_api or '(no range)'}, locked "
                f"{before.core_api or '(no range)'}"
            )
    was = {(point.slot, point.name): point.target for point in before.entry_points}
    now = {(point.slot, point.name): point.target for point in after.entry_points}
    for slot, point in sorted(was.keys() | now.keys()):
        if (slot, point) not in now:
            differences.append(f"{name}: entry point {slot} {point!r} ({was[slot, point]}) removed")
        elif (slot, point) not in was:
            differences.append(f"{name}: entry point {slot} {point!r} ({now[slot, point]}) added")
        elif was[slot, point] != now[slot, point]:
            differences.append(
                f"{name}: entry point {slot} {point!r} changed: locked {was[slot, point]}, installed {now[slot, point]}"
            )
    return differences


def _direction(locked: str, installed: str) -> str:
    try:
        return "upgraded" if Version(installed) > Version(locked) else "downgraded"
    except InvalidVersion:
        return "changed version"


def _record_sha256(distribution: str) -> str:
    try:
        record = metadata.distribution(distribution).read_text("RECORD")
    except metadata.PackageNotFoundError:
        return ""
    if record is None:
        return ""
    return hashlib.sha256("\n".join(_built_entries(record)).encode()).hexdigest()


def _built_entries(record: str) -> list[str]:
    """RECORD's ``path,hash`` entries of the build's own files, sorted (installers write them in any order)."""
    entries = []
    for row in csv.reader(record.splitlines()):
        if len(row) < 2 or not row[1]:
            continue
        path = row[0]
        folder, _, name = path.rpartition("/")
        installer_file = folder.endswith(".dist-info") and name in INSTALLER_FILES
        if installer_file or path.startswith("..") or Path(path).is_absolute():  # outside: bin/ scripts
            continue
        entries.append(f"{path},{row[1]}")
    return sorted(entries)
