"""Load plugins chosen by name, with stevedore, after the metadata checks pass.

A plugin the user selected that fails to load raises :class:`PluginError`
carrying the cause. When core loads every plugin of a slot on its own
initiative (platform probing, op selection, parsers), a broken plugin is
skipped and logged at DEBUG: nothing selected it, and ``weft plugins doctor``
reports every one with its fix (:mod:`weft.plugins.health`). A broken
``weft.hooks`` plugin is a warning: hooks take part by being installed, so
the user loses what it does. Each message is logged once per engine start:
once per process, and not at all above DEBUG in the processes an engine
starts for itself (the engine core process, workers), whose parent has
logged the same messages (:func:`problems_reported_by_parent`).
"""

from __future__ import annotations

import difflib
import logging
from importlib.metadata import EntryPoint
from typing import Any

import pluggy
from stevedore import DriverManager, NamedExtensionManager

from weft.contracts import SLOT_GROUPS
from weft.contracts import hooks as hookspecs
from weft.plugins.discovery import PluginEntry, allowlist, discover, unmatched_allowlist_names
from weft.plugins.errors import PluginError
from weft.plugins.trace import logger, trace, tracing_enabled


class _ChosenEntryPoints:
    """Make a stevedore manager load exactly the entry points discovery approved.

    stevedore would otherwise rescan the group and also import a disabled,
    incompatible or clashing entry point that shares the name.
    """

    def __init__(self, *args: Any, chosen: list[PluginEntry], **kwargs: Any) -> None:
        self._chosen = [EntryPoint(entry.name, entry.target, SLOT_GROUPS[entry.slot]) for entry in chosen]
        super().__init__(*args, **kwargs)

    def list_entry_points(self) -> list[EntryPoint]:
        return list(self._chosen)


class _Driver(_ChosenEntryPoints, DriverManager):
    pass


class _Named(_ChosenEntryPoints, NamedExtensionManager):
    pass


class PluginRegistry:
    """The installed plugins of every slot, loaded on demand."""

    def __init__(self, entries: list[PluginEntry] | None = None) -> None:
        self.entries = discover() if entries is None else entries
        self._loaded: dict[tuple[str, str], Any] = {}
        self._failures: dict[tuple[str, str], BaseException] = {}
        """What importing each plugin that failed raised; it is not imported again."""
        self._hooks: pluggy.PluginManager | None = None
        for name in unmatched_allowlist_names(self.entries, allowlist()):
            warn_plugin_problem(f"WEFT_PLUGINS names {name!r}, which matches no installed plugin or distribution")

    def slot_entries(self, slot: str) -> list[PluginEntry]:
        _check_slot(slot)
        return [entry for entry in self.entries if entry.slot == slot]

    def names(self, slot: str) -> list[str]:
        """Names of the loadable plugins of ``slot``."""
        return sorted({entry.name for entry in self.slot_entries(slot) if entry.status == "ok"})

    def find(self, slot: str, name: str) -> PluginEntry:
        """The usable entry ``slot``/``name``, or a PluginError saying why there is none."""
        matches = [entry for entry in self.slot_entries(slot) if entry.name == name]
        if not matches:
            known = self.names(slot)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"no {slot} plugin named {name!r} is installed; available: {', '.join(known) or 'none'}{hint}"
            )
        entry = matches[0]
        if entry.status != "ok":
            raise PluginError(f"{slot} {entry.describe()} cannot be used: {entry.problem}")
        return entry

    def load(self, slot: str, name: str) -> Any:
        """Import and return the object ``slot``/``name`` refers to (usually its class).

        Raises PluginError when it is missing, incompatible, clashing or fails to import.
        """
        key = (slot, name)
        if key in self._loaded:
            return self._loaded[key]
        entry = self.find(slot, name)
        if key not in self._failures:
            trace("load %s %r from %s %s (%s)", slot, name, entry.distribution, entry.version, entry.target)
            try:
                self._loaded[key] = _Driver(SLOT_GROUPS[slot], name, chosen=[entry]).driver
                return self._loaded[key]
            except Exception as error:
                self._failures[key] = error
        error = self._failures[key]
        raise PluginError(load_failure_message(entry, error)) from error

    def platforms_of(self, distribution: str) -> list[str]:
        """The names of the platform plugins ``distribution`` registers (from metadata)."""
        return [entry.name for entry in self.entries if entry.slot == "platform" and entry.distribution == distribution]

    def meant_for_another_platform(self, entry: PluginEntry, platform: str | None) -> bool:
        """Whether ``entry`` comes with platforms of its own, none of them ``platform`` (the one running).

        Such a plugin failing to load here is expected: weft-cuda's Triton ops on a CPU machine."""
        platforms = self.platforms_of(entry.distribution)
        return platform is not None and bool(platforms) and platform not in platforms

    def load_all(self, slot: str, prefix: str = "", *, platform: str | None = None) -> dict[str, Any]:
        """Load every usable plugin of ``slot`` (whose name starts with ``prefix``).

        Broken ones are left out and logged once (see the module docstring); ``platform`` names the
        platform running, when known: a plugin meant for another one that fails is logged at DEBUG.
        """
        entries = [entry for entry in self.slot_entries(slot) if entry.name.startswith(prefix)]
        for entry in entries:
            if entry.status in ("incompatible", "conflict"):
                quiet = entry.status == "incompatible" and slot != "hooks"  # a clash is the user's to resolve
                _report(
                    f"skipping {slot} {entry.describe()}: {entry.problem}", logging.DEBUG if quiet else logging.WARNING
                )
        for entry in entries:
            if (slot, entry.name) in self._failures:
                self._report_failure(entry, platform)
        wanted = [
            entry.name
            for entry in entries
            if entry.status == "ok"
            and (slot, entry.name) not in self._loaded
            and (slot, entry.name) not in self._failures
        ]
        if wanted:
            by_name = {entry.name: entry for entry in entries if entry.status == "ok"}
            for name in wanted:
                entry = by_name[name]
                trace("load %s %r from %s %s (%s)", slot, name, entry.distribution, entry.version, entry.target)

            def on_failure(_manager: Any, entry_point: Any, error: Exception) -> None:
                self._failures[(slot, entry_point.name)] = error
                self._report_failure(by_name[entry_point.name], platform)

            manager = _Named(
                SLOT_GROUPS[slot],
                names=wanted,
                on_load_failure_callback=on_failure,
                name_order=True,
                on_missing_entrypoints_callback=lambda names: None,
                chosen=[by_name[name] for name in wanted],
            )
            for extension in manager:
                self._loaded[(slot, extension.name)] = extension.plugin
        return {entry.name: self._loaded[(slot, entry.name)] for entry in entries if (slot, entry.name) in self._loaded}

    def hooks(self) -> pluggy.PluginManager:
        """The pluggy manager with every usable ``weft.hooks`` plugin registered."""
        if self._hooks is not None:
            return self._hooks
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        for name, plugin in self.load_all("hooks").items():
            try:
                manager.register(plugin, name=name)
                manager.check_pending()
            except pluggy.PluginValidationError as error:
                manager.unregister(plugin)
                warn_plugin_problem(f"hooks plugin {name!r} is invalid and is skipped: {error}")
        if tracing_enabled():
            manager.trace.root.setwriter(lambda message: trace("%s", message.rstrip()))
            manager.enable_tracing()
        self._hooks = manager
        return manager

    def _report_failure(self, entry: PluginEntry, platform: str | None) -> None:
        message = f"installed {load_failure_message(entry, self._failures[(entry.slot, entry.name)])}; it is skipped"
        if self.meant_for_another_platform(entry, platform):
            message += (
                f" (it is meant for platform {' or '.join(map(repr, self.platforms_of(entry.distribution)))}, not "
                f"{platform!r})"
            )
        _report(message, logging.WARNING if entry.slot == "hooks" else logging.DEBUG)


_reported: set[str] = set()
"""The plugin problems this process has logged."""
_parent_reported = False


def problems_reported_by_parent() -> None:
    """Log plugin problems at DEBUG only, from now on in this process: called first thing by the
    processes an engine starts for itself, whose parent logs the same problems at their level."""
    global _parent_reported
    _parent_reported = True


def _report(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time this process meets it."""
    if message not in _reported:
        _reported.add(message)
        logger.log(logging.DEBUG if _parent_reported else level, message)


def load_failure_message(entry: PluginEntry, error: BaseException) -> str:
    return f"{entry.slot} {entry.describe()} failed to load from {entry.target}: {type(error).__name__}: {error}"


def _check_slot(slot: str) -> None:
    if slot not in SLOT_GROUPS:
        raise PluginError(f"unknown plugin slot {slot!r}; slots are {', '.join(SLOT_GROUPS)}")


def warn_plugin_problem(message: str) -> None:
    """Report a problem with the plugin set that the user should see (once): a warning, not an error."""
    _report(message, logging.WARNING)
