"""Loading ``weft.toml``: the file, then overrides (CLI flags, keyword arguments of the Python API), validated
against the schema (:mod:`weft.config.schema`).

Values come from, in increasing precedence: the schema's defaults, the file,
then overrides. Every error names the source, the key path and what was
expected: ``weft.toml: engine.max_num_seqs: expected int, got str 'lots'``.
Checks that span options (the parallel layout, options that would do nothing)
run after the schema's own, and each plugin's ``[plugins.<name>]`` table is
checked against its Options Struct.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec

from weft.config.schema import EngineConfig, WeftConfig, executor_name, world_size


class ConfigError(ValueError):
    """The configuration is invalid; the message names the source, the key path and the fix."""


OVERRIDE_SOURCE = "override"


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    registry: Any = None,
) -> WeftConfig:
    """Load ``path`` (if given), apply ``overrides`` (nested dicts or dotted keys), validate.

    Plugin tables under ``[plugins.<name>]`` are validated against the named
    plugin's Options Struct, which imports that plugin (pass a
    :class:`weft.plugins.PluginRegistry` to reuse one).
    """
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise ConfigError(f"{source}: cannot read the config file: {error.strerror}") from None
        try:
            raw = msgspec.toml.decode(data)
        except msgspec.DecodeError as error:
            raise ConfigError(f"{source}: not valid TOML: {error}") from None
    lock = _take_plugins_lock(raw, source)
    if lock is not None:  # a lock named in the file is found next to it, wherever the command runs
        lock = str(Path(path).parent / lock)
    override_paths = set()
    for key, value in _flatten(overrides or {}):
        _set_path(raw, key, value)
        override_paths.add(key)
    overridden = _take_plugins_lock(raw, OVERRIDE_SOURCE)
    raw["plugins_lock"] = lock if overridden is None else overridden
    try:
        config = msgspec.convert(raw, WeftConfig)
    except msgspec.ValidationError as error:
        raise ConfigError(_explain(error, raw, WeftConfig, source, override_paths)) from None
    _check_parallel(config, source, override_paths)
    _check_generation_config(config, source, override_paths)
    _check_structured_output_fill(config, source, override_paths)
    _check_options_that_would_do_nothing(config, raw, source, override_paths)
    _check_speculative(config, source, override_paths, registry)
    if config.plugins:
        from weft.plugins import PluginRegistry

        plugins = validate_plugin_options(config, registry or PluginRegistry(), source, override_paths)
        config = msgspec.structs.replace(config, plugins=plugins)
    return config


def _check_speculative(config: WeftConfig, source: str, override_paths: set[str], registry: Any) -> None:
    """``[engine.speculative]``: an installed speculator, and a layout it runs in."""
    engine, speculative = config.engine, config.engine.speculative
    if not speculative.enabled:
        return
    where = (
        OVERRIDE_SOURCE
        if any(path.startswith("engine.speculative") for path in override_paths) or "engine" in override_paths
        else source
    )
    from weft.plugins import PluginRegistry

    installed = (registry or PluginRegistry()).names("speculator")
    if speculative.method not in installed:
        raise ConfigError(
            f"{where}: engine.speculative.method = {speculative.method!r} is not an installed speculator; installed: "
            f"{', '.join(sorted(installed)) or 'none'} (or 'none' to turn speculation off)"
        )
    if speculative.method == "draft" and not speculative.model:
        raise ConfigError(
            f"{where}: engine.speculative.method = 'draft' needs engine.speculative.model: a folder, file or alias of "
            f"a smaller model with the target's tokenizer"
        )
    if engine.pipeline_parallel_size > 1:
        raise ConfigError(
            f"{where}: engine.speculative.method = {speculative.method!r} with engine.pipeline_parallel_size = "
            f"{engine.pipeline_parallel_size}: speculative decoding runs without pipeline stages; use tensor "
            f"parallelism, or set method = 'none'"
        )


def _take_plugins_lock(raw: dict[str, Any], source: str) -> str | None:
    """Remove from ``raw`` the plugin lock it names, ``[plugins] lock`` or ``plugins_lock``, and return it.

    Taken from the file before the overrides apply and again after, so an override's lock wins and an override
    of the whole ``plugins`` table keeps the file's.
    """
    plugins = raw.get("plugins")
    named = {}
    if isinstance(plugins, dict) and "lock" in plugins:
        named["plugins.lock"] = plugins["lock"]
        raw["plugins"] = {key: value for key, value in plugins.items() if key != "lock"}
    if "plugins_lock" in raw:
        named["plugins_lock"] = raw.pop("plugins_lock")
    if len(named) > 1:
        raise ConfigError(
            f"{source}: plugins.lock and plugins_lock both name the plugin lock; keep [plugins] lock only"
        )
    for key, value in named.items():
        if not isinstance(value, str):
            table = "; a plugin named 'lock' takes its options as [plugins.\"<slot>.lock\"]"
            raise ConfigError(
                f"{source}: {key}: expected str (a lock file written by `weft plugins freeze`), got "
                f"{type(value).__name__} {value!r}{table if key == 'plugins.lock' else ''}"
            )
        return value
    return None


def _check_parallel(config: WeftConfig, source: str, override_paths: set[str]) -> None:
    """The parallel layout's own consistency (what needs the model or the devices is checked at start)."""
    engine = config.engine

    def where(*keys: str) -> str:
        return (
            OVERRIDE_SOURCE
            if any(_set_by_override(["engine", *key.split(".")], override_paths) for key in keys)
            else source
        )

    world = world_size(engine)
    sizes = (
        f"tensor_parallel_size x pipeline_parallel_size = {engine.tensor_parallel_size} x "
        f"{engine.pipeline_parallel_size} = {world} ranks"
    )
    if engine.distributed_executor_backend == "uniproc" and world > 1:
        raise ConfigError(
            f"{where('distributed_executor_backend', 'tensor_parallel_size', 'pipeline_parallel_size')}: "
            f"engine.distributed_executor_backend = 'uniproc' runs one worker in the engine core's process, but "
            f"{sizes}; use 'mp' (or 'ray'), or set both sizes to 1"
        )
    partition = engine.pipeline_partition
    if partition is not None and len(partition) != engine.pipeline_parallel_size:
        raise ConfigError(
            f"{where('pipeline_partition', 'pipeline_parallel_size')}: engine.pipeline_partition = {partition} lists "
            f"{len(partition)} stages but engine.pipeline_parallel_size = {engine.pipeline_parallel_size}; "
            f"give one layer count per stage"
        )
    nodes, node_rank = engine.distributed.nnodes, engine.distributed.node_rank
    if world == 1:
        # One rank runs in the engine core's process: nothing meets anyone, so these would do nothing.
        given = {
            key: value
            for key, value in msgspec.structs.asdict(engine.distributed).items()
            if key in ("nnodes", "node_rank", "master_addr", "master_port")
            and value is not None
            and (key, value) not in (("nnodes", 1), ("node_rank", 0))
        }
        if given:
            keys = [f"distributed.{key}" for key in given]
            raise ConfigError(
                f"{where(*keys)}: "
                f"{', '.join(f'engine.{key} = {value!r}' for key, value in zip(keys, given.values(), strict=False))} "
                f"but {sizes}: one rank runs in the engine core's process and meets no other; raise "
                "tensor_parallel_size or pipeline_parallel_size to spread the model over nodes, or remove "
                f"{'it' if len(given) == 1 else 'them'}"
            )
    if nodes is not None and node_rank is not None and node_rank >= nodes:
        raise ConfigError(
            f"{where('distributed.node_rank', 'distributed.nnodes')}: engine.distributed.node_rank = {node_rank} but "
            f"engine.distributed.nnodes = {nodes}; node ranks run from 0 to {nodes - 1}"
        )


def _check_structured_output_fill(config: WeftConfig, source: str, override_paths: set[str]) -> None:
    engine = config.engine
    if engine.structured_output_fill == "thread" and engine.structured_output_fill_processes is not None:
        keys = ("structured_output_fill", "structured_output_fill_processes")
        where = OVERRIDE_SOURCE if any(_set_by_override(["engine", key], override_paths) for key in keys) else source
        raise ConfigError(
            f"{where}: engine.structured_output_fill_processes = {engine.structured_output_fill_processes} but "
            f"engine.structured_output_fill = 'thread' fills on a thread of the engine core, in no process; set "
            f"structured_output_fill to 'process' (or 'auto'), or remove structured_output_fill_processes"
        )


def _check_options_that_would_do_nothing(
    config: WeftConfig, raw: dict[str, Any], source: str, override_paths: set[str]
) -> None:
    """An option given where another makes it do nothing is an error naming both, not a setting silently dropped."""
    engine = config.engine

    defaults = EngineConfig()

    def given(key: str) -> bool:
        """Set to a value other than its default (a file that spells out the defaults, as ``config show`` prints
        them, is not refused)."""
        found, value = _lookup(raw, ["engine", *key.split(".")])
        default: Any = defaults
        for part in key.split("."):
            default = getattr(default, part)
        return found and value != default

    def fail(keys: tuple[str, ...], message: str) -> None:
        where = (
            OVERRIDE_SOURCE
            if any(_set_by_override(["engine", *key.split(".")], override_paths) for key in keys)
            else source
        )
        raise ConfigError(f"{where}: {message}")

    if engine.enforce_eager and engine.graph_batch_sizes:
        fail(
            ("graph_batch_sizes", "enforce_eager"),
            f"engine.graph_batch_sizes = {engine.graph_batch_sizes} but engine.enforce_eager = true captures no "
            "graphs; remove graph_batch_sizes, or set enforce_eager to false",
        )
    if engine.num_kv_blocks is not None:
        for key in ("cpu_kv_cache_bytes", "gpu_memory_utilization"):
            if given(key):
                fail(
                    (key, "num_kv_blocks"),
                    f"engine.{key} = {getattr(engine, key)!r} sizes the KV cache, but engine.num_kv_blocks = "
                    f"{engine.num_kv_blocks} sets its size; keep one of them",
                )
    if not engine.enable_chunked_prefill:
        for key in ("long_prefill_token_threshold", "max_long_partial_prefills"):
            if given(key) and getattr(engine, key) != 0:  # 0: no cap, what config show prints here
                fail(
                    (key, "enable_chunked_prefill"),
                    f"engine.{key} = {getattr(engine, key)!r} paces long prefills over steps, which only chunked "
                    f"prefill splits, but engine.enable_chunked_prefill = false; remove it, or turn chunked prefill on",
                )
    if config.use.structured_output == "none":
        for key in ("structured_output_fill", "structured_output_fill_processes"):
            if given(key):
                fail(
                    (key,),
                    f"engine.{key} = {getattr(engine, key)!r} but use.structured_output = 'none' turns "
                    f"structured outputs off, so nothing is filled; remove it, or choose a backend",
                )
    if given("distributed.worker_timeout") and executor_name(engine) == "uniproc":
        fail(
            ("distributed.worker_timeout", "distributed_executor_backend"),
            f"engine.distributed.worker_timeout = {engine.distributed.worker_timeout:g} but the uniproc executor runs "
            f"its one worker in the engine core's process: no worker is started or waited for; remove it (the mp "
            f"and ray executors wait on it)",
        )
    if engine.revision is not None or engine.download_dir is not None:
        from weft.hub import is_repo_id

        if not is_repo_id(config.model):
            key = "revision" if engine.revision is not None else "download_dir"
            fail(
                (key,),
                f"engine.{key} = {getattr(engine, key)!r} applies to a Hugging Face repo id (org/name), but "
                f"model = {config.model!r} is not one (an alias, a local folder or file); remove it",
            )


def _check_generation_config(config: WeftConfig, source: str, override_paths: set[str]) -> None:
    """``engine.generation_config`` is a keyword or a folder holding generation_config.json (checked before any model
    loads)."""
    value = config.engine.generation_config
    if value in ("auto", "none") or (Path(value).expanduser() / "generation_config.json").is_file():
        return
    where = OVERRIDE_SOURCE if _set_by_override(["engine", "generation_config"], override_paths) else source
    raise ConfigError(
        f"{where}: engine.generation_config: {value!r} is neither 'auto', 'none' nor a folder holding a "
        f"generation_config.json; give 'auto' (the model's defaults), 'none' (Weft's) or such a folder"
    )


def parse_override(assignment: str) -> tuple[str, Any]:
    """``"engine.max_num_seqs=8"`` -> ``("engine.max_num_seqs", 8)``; values are TOML literals, else strings."""
    key, sep, text = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {assignment!r}: expected KEY=VALUE, e.g. engine.max_num_seqs=8")
    try:
        value = msgspec.toml.decode(f"value = {text}")["value"]
    except msgspec.DecodeError:
        value = text
    return key.strip(), value


def plugin_options(config: WeftConfig, options_type: type[msgspec.Struct], slot: str, name: str) -> msgspec.Struct:
    """The validated options of plugin ``slot``/``name`` (its defaults when the config has no table).

    The table is ``[plugins.<name>]``, or ``[plugins."<slot>.<name>"]`` when
    plugins of several slots share the name.
    """
    key = f"{slot}.{name}" if f"{slot}.{name}" in config.plugins else name
    table = config.plugins.get(key, {})
    try:
        return msgspec.convert(table, options_type)
    except msgspec.ValidationError as error:
        message = _explain(error, table, options_type, "config", set(), prefix=f"plugins.{key}")
        if key not in config.plugins:
            message += f" (there is no [plugins.{_table_key(key)}] table: add one that sets it)"
        raise ConfigError(message) from None


def _table_key(key: str) -> str:
    return key if "." not in key else f'"{key}"'


def plugin_table_key(entry: Any, entries: list[Any]) -> str:
    """The key of ``entry``'s options table under ``[plugins]``: its name, or ``<slot>.<name>`` when another of
    ``entries`` (the installed plugins) has the same name (``[plugins.<name>]`` would configure both) or the name
    is ``lock`` (``[plugins] lock`` is the plugin lock file)."""
    shared = entry.name == "lock" or any(other.name == entry.name and other.slot != entry.slot for other in entries)
    return f"{entry.slot}.{entry.name}" if shared else entry.name


def plugin_table(entry: Any, entries: list[Any]) -> str:
    """The weft.toml header of ``entry``'s options table: ``[plugins.<name>]`` or ``[plugins."<slot>.<name>"]``."""
    return f"[plugins.{_table_key(plugin_table_key(entry, entries))}]"


def plugin_entries_for_table(entries: list[Any], key: str) -> list[Any]:
    """The plugin entries a ``[plugins.<key>]`` table configures (``key`` may be ``slot.name``)."""
    from weft.contracts import SLOT_GROUPS

    slot, _, name = key.partition(".")
    if name and slot in SLOT_GROUPS:
        return [entry for entry in entries if entry.slot == slot and entry.name == name]
    return [entry for entry in entries if entry.name == key]


def validate_plugin_options(
    config: WeftConfig, registry: Any, source: str, override_paths: set[str] = frozenset()
) -> dict[str, dict[str, Any]]:
    """Check each ``[plugins.<name>]`` table; returns the tables with the plugins' defaults filled in."""
    from weft.contracts.plugin import NoOptions

    validated: dict[str, dict[str, Any]] = {}
    from weft.plugins import PluginError

    for name, table in config.plugins.items():
        entries = plugin_entries_for_table(registry.entries, name)
        if not entries:
            raise ConfigError(
                f"{source}: plugins.{name}: no installed plugin is named {name!r}; install it or remove the table"
            )
        option_types = []
        for entry in entries:
            try:
                plugin = registry.load(entry.slot, entry.name)
            except PluginError as error:
                raise ConfigError(f"{source}: plugins.{name}: {error}") from error
            options_type = getattr(plugin, "Options", NoOptions)
            if options_type is not NoOptions and options_type not in option_types:
                option_types.append(options_type)
        if len(option_types) > 1:
            choices = ", ".join(f'[plugins."{entry.slot}.{entry.name}"]' for entry in entries)
            raise ConfigError(f"{source}: plugins.{name}: several plugins are named {name!r}; use one of {choices}")
        if not option_types:
            if table:
                raise ConfigError(f"{source}: plugins.{name}: plugin {name!r} takes no options; remove the table")
            validated[name] = {}
            continue
        for options_type in option_types:
            try:
                validated[name] = {
                    **validated.get(name, {}),
                    **msgspec.to_builtins(msgspec.convert(table, options_type)),
                }
            except msgspec.ValidationError as error:
                prefix = f"plugins.{name}."
                inner = {path[len(prefix) :] for path in override_paths if path.startswith(prefix)}
                if f"plugins.{name}" in override_paths or "plugins" in override_paths:
                    inner.add("")
                message = _explain(error, table, options_type, source, inner, prefix=f"plugins.{name}")
                raise ConfigError(message) from None
    return validated


def to_builtins(config: WeftConfig, *, reveal_secrets: bool = False) -> dict[str, Any]:
    """The configuration as plain data, every key included (unset ones as None), the API key masked."""
    data = msgspec.to_builtins(config)
    data["plugins"] = {"lock": data.pop("plugins_lock"), **data["plugins"]}  # where weft.toml spells it
    if data["server"].get("api_key") and not reveal_secrets:
        data["server"]["api_key"] = "***"
    return data


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items = []
    for key, value in mapping.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and path != "plugins" and not path.startswith("use.ops"):
            items.extend(_flatten(value, path) if value else [(path, {})])
        else:
            items.append((path, value))
    return items


def split_key(dotted: str) -> list[str]:
    """A TOML key path as parts: ``plugins."platform.dual".threads`` -> ``[plugins, platform.dual, threads]``."""
    try:
        node = msgspec.toml.decode(f"{dotted} = 0")
    except msgspec.DecodeError:
        raise ConfigError(f"{OVERRIDE_SOURCE}: {dotted!r} is not a valid key path") from None
    parts = []
    while isinstance(node, dict) and len(node) == 1:
        key, node = next(iter(node.items()))
        parts.append(key)
    return parts


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    parts = split_key(dotted)
    for index, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{OVERRIDE_SOURCE}: {'.'.join(parts[: index + 1])}: is not a table, cannot set {dotted}")
        node = child
    node[parts[-1]] = value


_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_PATH_TOKEN = re.compile(r'\.([^.\[]+)|\[(\d+|\.\.\.)\]|\["((?:[^"\\]|\\.)*)"\]')


def _explain(
    error: msgspec.ValidationError,
    raw: Any,
    root: type[msgspec.Struct],
    source: str,
    override_paths: set[str],
    prefix: str = "",
) -> str:
    match = _AT.match(str(error))
    message, path_text = match["message"], match["path"] or ""
    parts = [token[0] or token[1] or token[2] for token in _PATH_TOKEN.findall(path_text)]
    parts = _name_dict_keys(raw, parts, message)
    unknown = re.match(r"Object contains unknown field `(.*)`", message)
    if unknown:
        field = unknown[1]
        valid = (
            [f.encode_name for f in msgspec.structs.fields(_struct_at(root, parts))] if _struct_at(root, parts) else []
        )
        close = difflib.get_close_matches(field, valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        parts.append(field)
        explanation = f"unknown key{hint or '.'} Valid keys here: {', '.join(valid)}" if valid else "unknown key"
    elif message.startswith("Invalid enum value") and _literal_choices(root, parts):
        found, value = _lookup(raw, parts)
        choices = ", ".join(repr(choice) for choice in _literal_choices(root, parts))
        explanation = f"expected one of {choices}, got {value!r}"
    else:
        # TOML has no null, so an optional key's "| null" is no choice a weft.toml can make.
        explanation = message.replace("`", "").replace(" | null", "")
        explanation = explanation[:1].lower() + explanation[1:]
        found, value = _lookup(raw, parts)
        if found and ", got " in explanation:
            explanation += f" {value!r}"
        elif found and not message.startswith("Object missing required field"):
            explanation += f", got {type(value).__name__} {value!r}"
    key = ".".join(p for p in ([prefix] if prefix else []) + parts).replace(".[...]", "[...]").replace("....", "[...]")
    where = OVERRIDE_SOURCE if _set_by_override(parts, override_paths) else source
    return f"{where}: {key or '(top level)'}: {explanation}"


_EXPECTED_PYTHON_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "object": dict, "array": list}


def _name_dict_keys(raw: Any, parts: list[str], message: str) -> list[str]:
    """Replace msgspec's ``[...]`` (a dict value) with the key whose value has the wrong type."""
    expected = re.match(r"Expected `(\w+)", message)
    wanted = _EXPECTED_PYTHON_TYPES.get(expected[1]) if expected else None
    resolved: list[str] = []
    for part in parts:
        if part == "...":
            found, node = _lookup(raw, resolved)
            keys = (
                [
                    key
                    for key, value in node.items()
                    if wanted is None or not isinstance(value, wanted) or (wanted is int and isinstance(value, bool))
                ]
                if found and isinstance(node, dict)
                else []
            )
            part = keys[0] if len(keys) == 1 or (keys and part is parts[-1]) else "..."
        resolved.append(part)
    return resolved


def _set_by_override(parts: list[str], override_paths: set[str]) -> bool:
    """Whether the value at ``parts`` (or a table containing it) came from an override."""
    return any(".".join(parts[:length]) in override_paths for length in range(len(parts) + 1))


def _struct_at(root: type[msgspec.Struct], parts: list[str]) -> type[msgspec.Struct] | None:
    current: Any = root
    for part in parts:
        fields = {f.encode_name: f for f in msgspec.structs.fields(current)} if _is_struct(current) else {}
        if part not in fields:
            return None
        current = fields[part].type
    return current if _is_struct(current) else None


def _literal_choices(root: type[msgspec.Struct], parts: list[str]) -> tuple[Any, ...]:
    parent = _struct_at(root, parts[:-1]) if parts else None
    if parent is None:
        return ()
    field = {f.encode_name: f for f in msgspec.structs.fields(parent)}.get(parts[-1])
    field_type = field.type if field else None
    while get_origin(field_type) is Annotated:
        field_type = get_args(field_type)[0]
    return get_args(field_type) if get_origin(field_type) is Literal else ()


def _is_struct(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, msgspec.Struct)


def _lookup(raw: Any, parts: list[str]) -> tuple[bool, Any]:
    node = raw
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node
