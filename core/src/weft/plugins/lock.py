"""The plugin lock: the exact installed plugin set, frozen to a file and checked at every engine start.

``weft plugins freeze > weft.lock`` writes, as TOML, every distribution that
registers a Weft entry point (weft-core included): its name and version, the
weft-core range it declares, the SHA-256 of its ``RECORD`` (the installed files
and their hashes, so a rebuild under the same version shows), and its entry
points with their targets. Discovery's metadata is all it reads: nothing is
imported.

When ``plugins_lock`` in weft.toml (relative to that file) or the
``WEFT_PLUGINS_LOCK`` variable names a lock, :func:`verify_plugin_lock` refuses
an engine start whose installed set differs, naming each difference: a
distribution upgraded, downgraded, rebuilt, added or removed, a declared
weft-core range changed, an entry point added, removed or pointing elsewhere.
``weft plugins doctor`` runs the same check.
"""

from __future__ import annotations

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
LOCK_FORMAT = 1
"""The version of the lock file's layout; a lock of another layout is refused."""


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
    """SHA-256 of the distribution's RECORD file ('' when it has none, as with some development installs)."""
    entry_points: list[LockedEntryPoint]


class PluginLock(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lock_format: int
    distributions: list[LockedDistribution]


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
                name=name, version=first.version, core_api=first.core_api, record_sha256=_record_sha256(name),
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
        f"# set when weft.toml's plugins_lock or {LOCK_VARIABLE} names this file.\n"
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
        return config.plugins_lock, "plugins_lock in the configuration"
    if os.environ.get(LOCK_VARIABLE):
        return os.environ[LOCK_VARIABLE], LOCK_VARIABLE
    return None


def verify_plugin_lock(config: WeftConfig) -> None:
    """Refuse (PluginError) when the configuration names a plugin lock and the installed set differs from it."""
    named = lock_path(config)
    if named is None:
        return
    path, source = named
    differences = lock_differences(read_lock(path), installed_plugin_set())
    if differences:
        listed = "".join(f"\n  - {difference}" for difference in differences)
        raise PluginError(
            f"the installed plugins differ from the lock {path} (named by {source}):{listed}\n"
            f"Install the locked set, or accept the installed one with `weft plugins freeze > {path}`"
        )


def _distribution_differences(before: LockedDistribution, after: LockedDistribution) -> list[str]:
    name = after.name
    differences = []
    if before.version != after.version:
        differences.append(f"{name} {_direction(before.version, after.version)}: locked {before.version}, installed {after.version}")
    else:
        if before.record_sha256 != after.record_sha256:
            differences.append(
                f"{name} {after.version} reinstalled from a different build: its RECORD hash is "
                f"{after.record_sha256[:16] or 'absent'}, locked {before.record_sha256[:16] or 'absent'}"
            )
        if before.core_api != after.core_api:
            differences.append(
                f"{name} {after.version} declares weft-core {after.core_api or '(no range)'}, locked {before.core_api or '(no range)'}"
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
    return hashlib.sha256(record.encode()).hexdigest() if record is not None else ""
