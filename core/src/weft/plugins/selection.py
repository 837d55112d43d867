"""Turn the ``[use]`` table into concrete plugins: probe platforms, choose op implementations."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weft.plugins.errors import PluginError
from weft.plugins.registry import PluginRegistry, warn_plugin_problem

if TYPE_CHECKING:
    from weft.config import UseConfig, WeftConfig
    from weft.contracts.ops import OpImplementation
    from weft.contracts.platform import Platform, PlatformProbe


def probe_platforms(registry: PluginRegistry) -> dict[str, tuple[type[Platform], PlatformProbe]]:
    """Load and probe every usable platform; a platform whose probe raises is warned about and left out."""
    from weft.contracts.platform import PlatformProbe

    probed = {}
    for name, platform in registry.load_all("platform").items():
        try:
            probe = platform.probe()
            if not isinstance(probe, PlatformProbe):
                raise TypeError(f"probe() returned {type(probe).__name__}, expected PlatformProbe")
        except Exception as error:
            warn_plugin_problem(f"platform {name!r} failed to probe and is skipped: {type(error).__name__}: {error}")
            continue
        probed[name] = (platform, probe)
    return probed


def select_platform(registry: PluginRegistry, name: str = "auto") -> tuple[type[Platform], PlatformProbe]:
    """The platform ``use.platform`` names, or under ``auto`` the available one of highest priority."""
    if name != "auto":
        platform = registry.load("platform", name)
        probe = platform.probe()
        if not probe.available:
            raise PluginError(f"platform {name!r} is not available here: {probe.reason}")
        return platform, probe
    available = [
        (probe.priority, name, platform, probe)
        for name, (platform, probe) in probe_platforms(registry).items()
        if probe.available
    ]
    if not available:
        raise PluginError("no platform is available; install weft-core (it provides 'cpu') or set use.platform")
    available.sort(key=lambda item: item[0], reverse=True)
    best = [item for item in available if item[0] == available[0][0]]
    if len(best) > 1:
        names = ", ".join(repr(item[1]) for item in best)
        raise PluginError(
            f"several platforms are available with equal priority ({names}); choose one with use.platform"
        )
    return best[0][2], best[0][3]


def choose_op(registry: PluginRegistry, op: str, platform: Platform, forced: str | None = None) -> OpImplementation:
    """The implementation of ``op`` to run on ``platform`` (``forced``: the one ``use.ops`` names)."""
    if forced is not None:
        implementation = registry.load("ops", f"{op}.{forced}")
        if not implementation.runs_on(platform.name) or not implementation.is_available(platform):
            raise PluginError(
                f"use.ops.{op} = {forced!r}: that implementation cannot run on platform {platform.name!r}"
            )
        return implementation(platform)
    candidates: list[Any] = [
        implementation
        for name, implementation in registry.load_all("ops", prefix=f"{op}.", platform=platform.name).items()
        if implementation.runs_on(platform.name) and implementation.is_available(platform)
    ]
    if not candidates:
        raise PluginError(f"no implementation of op {op!r} runs on platform {platform.name!r}")
    return max(candidates, key=lambda implementation: implementation.priority)(platform)


def select_structured_output(registry: PluginRegistry, name: str) -> Any:
    """The structured-output backend class ``use.structured_output`` names; under ``auto`` the installed
    one of highest priority; None for ``none`` or when none is installed."""
    if name == "none":
        return None
    if name != "auto":
        return registry.load("structured_output", name)
    backends = registry.load_all("structured_output")
    if not backends:
        return None
    return max(backends.values(), key=lambda backend: backend.priority)


def select_parser(registry: PluginRegistry, slot: str, name: str, architecture: str | None) -> Any:
    """The ``tool_parser``, ``reasoning_parser`` or ``mm_processor`` class ``name`` selects; under ``auto`` the one
    whose ``architectures`` lists ``architecture``; None for ``none`` or when no parser claims it."""
    if name == "none":
        return None
    if name != "auto":
        return registry.load(slot, name)
    claiming = sorted(
        (parser_name, parser)
        for parser_name, parser in registry.load_all(slot).items()
        if architecture in getattr(parser, "architectures", ())
    )
    if len(claiming) > 1:
        names = ", ".join(repr(parser_name) for parser_name, _ in claiming)
        raise PluginError(
            f"several {slot} plugins ({names}) are made for architecture {architecture!r}; choose one with use.{slot}"
        )
    return claiming[0][1] if claiming else None


def plugins_named_in_use(use: UseConfig) -> list[tuple[str, str, str]]:
    """``(key, slot, plugin name)`` of each plugin ``[use]`` names (``auto`` and ``none`` name none)."""
    named = [
        (slot, slot, getattr(use, slot))
        for slot in ("platform", "attention", "loader", "tokenizer")
        if getattr(use, slot) != "auto"
    ]
    if use.kv_connector != "none":
        named.append(("kv_connector", "kv_connector", use.kv_connector))
    named += [
        (slot, slot, getattr(use, slot))
        for slot in ("structured_output", "tool_parser", "reasoning_parser", "mm_processor", "encoder_connector")
        if getattr(use, slot) not in ("auto", "none")
    ]
    named += [(f"ops.{op}", "ops", f"{op}.{implementation}") for op, implementation in use.ops.items()]
    return named


def use_problems(use: UseConfig, registry: PluginRegistry) -> list[str]:
    """One line per plugin ``[use]`` names that is not installed or cannot be used (from metadata, importing nothing).

    ``weft plugins doctor`` reports the same lines (it then also imports them)."""
    problems = []
    for key, slot, name in plugins_named_in_use(use):
        try:
            registry.find(slot, name)
        except PluginError as error:
            problems.append(f"{use_label(key, use)}: {error}")
    return problems


def use_label(key: str, use: UseConfig) -> str:
    """``use.kv_connector = 'diskstore'``: how doctor and ``config show`` name a ``[use]`` key."""
    value = use.ops[key.partition(".")[2]] if key.startswith("ops.") else getattr(use, key)
    return f"use.{key} = {value!r}"


def no_backend_message(config: WeftConfig) -> str:
    """Why a request's structured-output constraint has no backend to compile it, and the fix."""
    if config.use.structured_output == "none":
        return "structured outputs are off (use.structured_output = 'none'); remove the constraint or turn them on"
    return "structured outputs need a backend and none is installed; pip install weft-xgrammar"
