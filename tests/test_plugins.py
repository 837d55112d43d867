"""Plugin machinery against real throwaway distributions discovered through importlib.metadata."""

from __future__ import annotations

import json

from conftest import last_json, platform_module
from weft.contracts import CORE_API

BUILTIN_PLATFORMS = {"cpu": "weft-core", "cuda": "weft-cuda", "rocm": "weft-rocm", "xpu": "weft-xpu"}


def test_listing_imports_no_torch_and_no_plugin_module(site):
    site.add_distribution(
        "weft-spy",
        entry_points={"weft.platform": {"spy": "spy_impl:SpyPlatform"}, "weft.hooks": {"spy-hooks": "spy_hooks"}},
        modules={
            "spy_impl": "raise RuntimeError('imported during listing')",
            "spy_hooks": "raise RuntimeError('imported')",
        },
    )
    result = site.python(
        """
        import io, json, sys, contextlib
        from weft.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plugins", "list", "--json"])
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                       ("torch", "triton", "spy_impl", "spy_hooks", "weft_cuda", "weft_rocm", "weft_xpu", "weft_triton",
                        "weft_example_bytes")
                       or m.startswith("weft.builtins"))
        print(json.dumps({"code": code, "heavy": heavy, "listing": json.loads(out.getvalue())}))
        """
    )
    assert result.returncode == 0, result.stderr
    report = last_json(result.stdout)
    assert report["code"] == 0
    assert report["heavy"] == []
    rows = {(row["slot"], row["name"]): row for row in report["listing"]["plugins"]}
    assert rows[("platform", "spy")]["status"] == "ok"
    for name, distribution in BUILTIN_PLATFORMS.items():
        row = rows[("platform", name)]
        assert row["distribution"] == distribution and row["version"] and row["core_api"]


def test_incompatible_plugin_is_refused_before_import(site):
    site.add_distribution(
        "weft-future",
        version="3.1.0",
        requires=("weft-core>=2,<3",),
        entry_points={"weft.platform": {"future": "future_impl:FuturePlatform"}},
        modules={"future_impl": platform_module("future", cls="FuturePlatform")},
    )
    result = site.python(
        """
        import sys
        from weft.plugins import PluginError, PluginRegistry
        try:
            PluginRegistry().load("platform", "future")
        except PluginError as error:
            print(error)
        print("imported" if "future_impl" in sys.modules else "not imported")
        """
    )
    assert result.returncode == 0, result.stderr
    message, imported = result.stdout.strip().splitlines()
    assert "weft-future 3.1.0" in message and "requires weft-core API >=2,<3" in message
    assert f"installed core API is {CORE_API[0]}.{CORE_API[1]}" in message
    assert imported == "not imported"


def test_plugin_without_a_core_range_is_refused(site):
    site.add_distribution(
        "weft-vague", requires=(), entry_points={"weft.platform": {"vague": "vague_impl:P"}}, modules={"vague_impl": ""}
    )
    result = site.weft("plugins", "list", "--json")
    rows = {row["name"]: row for row in last_json(result.stdout)["plugins"]}
    assert rows["vague"]["status"] == "incompatible"
    assert "declares no weft-core API range" in rows["vague"]["problem"]


def test_name_registered_twice_is_an_error_naming_both_distributions(site):
    for distribution in ("weft-alpha", "weft-beta"):
        module = distribution.replace("-", "_")
        site.add_distribution(
            distribution,
            entry_points={"weft.platform": {"twin": f"{module}:TwinPlatform"}},
            modules={module: platform_module("twin", cls="TwinPlatform")},
        )
    result = site.python(
        """
        from weft.plugins import PluginError, PluginRegistry
        try:
            PluginRegistry().load("platform", "twin")
            print("loaded")
        except PluginError as error:
            print(error)
        """
    )
    assert "weft-alpha 0.1.0" in result.stdout and "weft-beta 0.1.0" in result.stdout
    assert "loaded" not in result.stdout
    doctor = site.weft("plugins", "doctor")
    assert doctor.returncode == 1
    assert "weft-alpha" in doctor.stdout and "weft-beta" in doctor.stdout
    # Excluding one of them with the allowlist resolves the clash.
    allowed = site.python(
        "from weft.plugins import PluginRegistry; print(PluginRegistry().load('platform', 'twin').__module__)",
        WEFT_PLUGINS="weft-alpha",
    )
    assert allowed.stdout.strip() == "weft_alpha", allowed.stderr


def test_selected_broken_plugin_is_a_hard_error_with_its_cause(site):
    site.add_distribution(
        "weft-broken",
        entry_points={"weft.platform": {"broken": "broken_impl:BrokenPlatform"}},
        modules={"broken_impl": "import not_installed_dependency_xyz\n"},
    )
    result = site.python(
        """
        from weft.plugins import PluginError, PluginRegistry
        from weft.plugins.selection import select_platform
        try:
            select_platform(PluginRegistry(), "broken")
        except PluginError as error:
            print(error)
            print(type(error.__cause__).__name__)
        """
    )
    message, cause = result.stdout.strip().splitlines()
    assert "platform plugin 'broken' (weft-broken 0.1.0) failed to load" in message
    assert "not_installed_dependency_xyz" in message
    assert cause == "ModuleNotFoundError"
    # The same plugin selected through weft.toml makes doctor fail with the cause.
    doctor = site.weft("plugins", "doctor", "--platform", "broken")
    assert doctor.returncode == 1 and "not_installed_dependency_xyz" in doctor.stdout


def test_an_unselected_incompatible_plugin_is_logged_at_debug_and_a_clash_is_a_warning(site):
    site.add_distribution(
        "weft-future",
        requires=("weft-core>=2,<3",),
        entry_points={"weft.platform": {"future": "future_impl:F"}},
        modules={"future_impl": "raise SystemExit(9)"},
    )
    for distribution in ("weft-alpha", "weft-beta"):
        site.add_distribution(
            distribution, entry_points={"weft.platform": {"twin": "twin_impl:T"}}, modules={"twin_impl": ""}
        )
    code = (
        "import logging, sys\n{}from weft.plugins import PluginRegistry\nfrom weft.plugins.selection import "
        "select_platform\nprint(select_platform(PluginRegistry())[0].name)"
    )
    result = site.python(code.format(""))
    assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr
    assert "future" not in result.stderr  # nothing selected it: doctor reports it (a warning there)
    assert (
        "skipping platform plugin 'twin'" in result.stderr and "weft-alpha 0.1.0 and weft-beta 0.1.0" in result.stderr
    )
    verbose = site.python(code.format("logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"))
    assert "skipping platform plugin 'future' (weft-future 0.1.0): " in verbose.stderr, verbose.stderr
    doctor = site.weft("plugins", "doctor")
    assert "warn  platform/future: " in doctor.stdout, doctor.stdout


def test_an_unselected_broken_plugin_is_logged_at_debug_and_reported_by_doctor(site):
    site.add_distribution(
        "weft-broken",
        entry_points={"weft.platform": {"broken": "broken_impl:BrokenPlatform"}},
        modules={"broken_impl": "raise ImportError('libfoo.so: cannot open shared object file')\n"},
    )
    code = """
        import logging, sys
        {}
        from weft.plugins import PluginRegistry
        from weft.plugins.selection import select_platform
        platform, probe = select_platform(PluginRegistry(), "auto")
        print(platform.name)
        """
    result = site.python(code.format(""))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"
    assert "broken" not in result.stderr, result.stderr  # nothing selected it
    verbose = site.python(code.format("logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)"))
    assert (
        "platform plugin 'broken' (weft-broken 0.1.0) failed to load" in verbose.stderr
        and "libfoo.so" in verbose.stderr
    )
    doctor = site.weft("plugins", "doctor")
    # A platform plugin that does not import is a platform this machine lacks: a warning, as for weft-cuda without CUDA.
    assert doctor.returncode == 0 and "warn  platform/broken (weft-broken 0.1.0) does not import" in doctor.stdout, (
        doctor.stdout
    )
    assert "fix: install the system library libfoo.so" in doctor.stdout


def test_allowlist_none_disables_third_party_plugins(site):
    site.add_distribution(
        "weft-extra",
        entry_points={"weft.platform": {"extra": "extra_impl:X"}},
        modules={"extra_impl": platform_module("extra", cls="X")},
    )
    result = site.weft("plugins", "list", "--json", WEFT_PLUGINS="none")
    rows = {row["name"]: row for row in last_json(result.stdout)["plugins"]}
    assert rows["cpu"]["status"] == "ok"
    assert rows["extra"]["status"] == "disabled" and rows["cuda"]["status"] == "disabled"
    load = site.python(
        """
        from weft.plugins import PluginError, PluginRegistry
        try:
            PluginRegistry().load("platform", "extra")
        except PluginError as error:
            print(error)
        """,
        WEFT_PLUGINS="none",
    )
    assert "excluded by WEFT_PLUGINS='none'" in load.stdout


def test_allowlist_name_matching_nothing_is_reported(site):
    site.add_distribution(
        "weft-extra",
        entry_points={"weft.platform": {"extra": "extra_impl:X"}},
        modules={"extra_impl": platform_module("extra", cls="X")},
    )
    listing = site.weft("plugins", "list", "--json", WEFT_PLUGINS="extra,weft-cuda,no-such-plugin")
    report = last_json(listing.stdout)
    assert report["unmatched_allowlist"] == ["no-such-plugin"]
    rows = {row["name"]: row["status"] for row in report["plugins"]}
    assert rows["extra"] == "ok" and rows["cuda"] == "ok" and rows["rocm"] == "disabled"
    assert rows["decode_topk.triton"] == "ok"  # weft-cuda requires weft-triton, which comes with it
    loading = site.python("from weft.plugins import PluginRegistry; PluginRegistry()", WEFT_PLUGINS="no-such-plugin")
    assert "WEFT_PLUGINS names 'no-such-plugin', which matches no installed plugin" in loading.stderr


def test_trace_logs_loads_and_hook_calls(site):
    site.add_distribution(
        "weft-traced",
        entry_points={"weft.hooks": {"traced": "traced_hooks"}, "weft.platform": {"traced": "traced_platform:T"}},
        modules={
            "traced_hooks": """
                from weft.contracts.hooks import hookimpl

                @hookimpl
                def weft_request_finished(request_id, finish_reason):
                    print("hook saw", request_id, finish_reason)
            """,
            "traced_platform": platform_module("traced", cls="T"),
        },
    )
    code = """
        from weft.plugins import PluginRegistry
        registry = PluginRegistry()
        registry.load("platform", "traced")
        registry.hooks().hook.weft_request_finished(
            request_id="r1", finish_reason="stop", num_prompt_tokens=3, num_output_tokens=4)
    """
    traced = site.python(code, WEFT_TRACE_PLUGINS="1")
    assert traced.returncode == 0, traced.stderr
    assert "hook saw r1 stop" in traced.stdout
    assert "load platform 'traced' from weft-traced 0.1.0 (traced_platform:T)" in traced.stderr
    assert "load hooks 'traced'" in traced.stderr
    assert "weft_request_finished" in traced.stderr and "request_id: r1" in traced.stderr
    quiet = site.python(code)
    assert "weft_request_finished" not in quiet.stderr and "load platform" not in quiet.stderr


def test_hooks_plugin_with_an_unknown_hook_is_skipped_with_a_warning(site):
    site.add_distribution(
        "weft-typo",
        entry_points={"weft.hooks": {"typo": "typo_hooks"}},
        modules={
            "typo_hooks": """
                from weft.contracts.hooks import hookimpl

                @hookimpl
                def weft_request_finnished(request_id):
                    pass
            """
        },
    )
    result = site.python("from weft.plugins import PluginRegistry; print(PluginRegistry().hooks().get_plugins())")
    assert result.returncode == 0, result.stderr
    assert "hooks plugin 'typo' is invalid" in result.stderr and "weft_request_finnished" in result.stderr


def test_unknown_plugin_name_suggests_a_close_one(site):
    result = site.python(
        """
        from weft.plugins import PluginError, PluginRegistry
        try:
            PluginRegistry().load("platform", "cdua")
        except PluginError as error:
            print(error)
        """
    )
    assert "no platform plugin named 'cdua'" in result.stdout and "did you mean 'cuda'?" in result.stdout


def test_auto_platform_prefers_priority_and_refuses_ties(site):
    site.add_distribution(
        "weft-fast",
        entry_points={"weft.platform": {"fast": "fast_impl:Fast"}},
        modules={"fast_impl": platform_module("fast", available=True, priority=50, cls="Fast")},
    )
    chosen = site.python(
        "from weft.plugins import PluginRegistry\nfrom weft.plugins.selection import select_platform\n"
        "print(select_platform(PluginRegistry())[0].name)"
    )
    assert chosen.stdout.strip() == "fast", chosen.stderr
    site.add_distribution(
        "weft-twin-fast",
        entry_points={"weft.platform": {"fast2": "fast2_impl:Fast2"}},
        modules={"fast2_impl": platform_module("fast2", available=True, priority=50, cls="Fast2")},
    )
    tie = site.weft("plugins", "doctor")
    assert tie.returncode == 1
    assert "several platforms are available with equal priority ('fast', 'fast2')" in tie.stdout
    named = site.weft("plugins", "doctor", "--platform", "fast2")
    assert "ok    use.platform = 'fast2'" in named.stdout


def test_inspect_prints_the_option_schema(site):
    site.add_distribution(
        "weft-opts",
        entry_points={"weft.kv_connector": {"store": "store_impl:Store"}},
        modules={
            "store_impl": """
                from typing import Annotated
                import msgspec
                from weft.contracts.kv_connector import KVConnector

                class StoreOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                    master: Annotated[str, msgspec.Meta(description="host:port of the master")]
                    segment_bytes: Annotated[int, msgspec.Meta(ge=1, description="bytes per segment")] = 1024

                class Store(KVConnector):
                    '''A throwaway KV store connector.'''
                    name = "store"
                    Options = StoreOptions
            """
        },
    )
    text = site.weft("plugins", "inspect", "store")
    assert text.returncode == 0, text.stderr
    assert "kv_connector plugin 'store': A throwaway KV store connector." in text.stdout
    assert "master" in text.stdout and "(required)" in text.stdout and "host:port of the master" in text.stdout
    assert "segment_bytes" in text.stdout and "1024" in text.stdout
    schema = last_json(site.weft("plugins", "inspect", "store", "--json").stdout)
    assert schema["distribution"] == "weft-opts"
    assert json.dumps(schema["options"]).count("segment_bytes") >= 1


def test_inspect_and_config_show_name_the_table_of_a_shared_name(site, tmp_path):
    """Two plugins named 'store' (a connector with options, a hook): [plugins.store] would configure both, so
    inspect and config show name [plugins."kv_connector.store"], and a weft.toml using that header loads."""
    site.add_distribution(
        "weft-twin-store",
        entry_points={
            "weft.kv_connector": {"store": "twin_store:Store"},
            "weft.hooks": {"store": "twin_store_hooks"},
        },
        modules={
            "twin_store": """
                import msgspec
                from weft.contracts.kv_connector import KVConnector

                class StoreOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                    segment_bytes: int = 1024

                class Store(KVConnector):
                    '''A throwaway KV store connector.'''
                    name = "store"
                    Options = StoreOptions
            """,
            "twin_store_hooks": "",
        },
    )
    header = '[plugins."kv_connector.store"]'
    inspected = site.weft("plugins", "inspect", "kv_connector.store")
    assert inspected.returncode == 0, inspected.stderr
    assert f"options ({header} in weft.toml)" in inspected.stdout
    (tmp_path / "weft.toml").write_text(f"{header}\nsegment_bytes = 7\n")
    shown = site.weft("config", "show", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[lines.index(header) + 1] == "segment_bytes = 7"
    assert "[plugins.store]" not in lines


def test_plugins_contribute_cli_commands_through_the_hook(site):
    site.add_distribution(
        "weft-greeter",
        entry_points={"weft.hooks": {"greeter": "greeter_hooks"}},
        modules={
            "greeter_hooks": """
                from weft.contracts.hooks import CliCommand, hookimpl

                def add_arguments(parser):
                    parser.add_argument("--name", required=True)

                def run(args):
                    print(f"hello {args.name}")
                    return 3

                @hookimpl
                def weft_cli_commands():
                    return [CliCommand(name="greet", help="say hello", add_arguments=add_arguments, run=run)]
            """
        },
    )
    result = site.weft("greet", "--name", "weft")
    assert result.returncode == 3 and result.stdout.strip() == "hello weft", result.stderr
    assert "greet" in site.weft("--help").stdout
    # A second plugin offering the same command is ignored with a warning, not a crash.
    site.add_distribution(
        "weft-greeter-two",
        entry_points={"weft.hooks": {"greeter-two": "greeter_two_hooks"}},
        modules={"greeter_two_hooks": "from greeter_hooks import weft_cli_commands\n"},
    )
    again = site.weft("greet", "--name", "weft")
    assert again.returncode == 3 and "command 'greet' is already taken" in again.stderr
    unknown = site.weft("nonsense")
    assert unknown.returncode == 2 and "invalid choice: 'nonsense'" in unknown.stderr


def test_doctor_passes_on_a_healthy_install(site):
    result = site.weft("plugins", "doctor")
    assert result.returncode == 0, result.stdout
    assert "ok    use.platform = 'auto'" in result.stdout and "-> 'torch'" in result.stdout
    assert "no problems found" in result.stdout


def add_fastops(site):
    """A platform-neutral op plugin whose module imports a dependency that is not installed (declared in an extra)."""
    site.add_distribution(
        "weft-fastops",
        requires=("weft-core>=1.0,<2", "fastops-kernels>=2; extra == 'kernels'"),
        entry_points={"weft.ops": {"rms_norm.fast": "fastops_impl:FastRmsNorm"}},
        modules={"fastops_impl": "import fastops_kernels\n"},
    )


def add_accel(site):
    """A platform distribution (its platform unavailable here) whose op fails to import, as weft-cuda's Triton ops do
    on a machine without triton."""
    site.add_distribution(
        "weft-accel",
        entry_points={
            "weft.platform": {"accel": "accel_platform:Accel"},
            "weft.ops": {"rms_norm.accel": "accel_ops:AccelRmsNorm"},
        },
        modules={"accel_platform": platform_module("accel", cls="Accel"), "accel_ops": "import accel_runtime_xyz\n"},
    )


def test_doctor_and_list_check_report_a_plugin_that_does_not_import_with_the_fix(site):
    add_fastops(site)
    doctor = site.weft("plugins", "doctor")
    assert doctor.returncode == 1, doctor.stdout
    assert (
        "FAIL  ops/rms_norm.fast (weft-fastops 0.1.0) does not import: "
        "ModuleNotFoundError: No module named 'fastops_kernels'" in doctor.stdout
    )
    assert (
        "fix: install fastops_kernels (pip install 'weft-fastops[kernels]' installs fastops-kernels>=2)"
        in doctor.stdout
    )
    assert "no problems found" not in doctor.stdout

    plain = {row["name"]: row for row in last_json(site.weft("plugins", "list", "--json").stdout)["plugins"]}
    assert plain["rms_norm.fast"]["status"] == "ok"  # metadata only: the listing does not import it
    checked = site.weft("plugins", "list", "--check", "--json")
    assert checked.returncode == 1, checked.stderr  # as doctor: a plugin that could run here does not import
    rows = {row["name"]: row for row in last_json(checked.stdout)["plugins"]}
    assert rows["rms_norm.fast"]["status"] == "broken"
    assert rows["rms_norm.fast"]["problem"].startswith(
        "ModuleNotFoundError: No module named 'fastops_kernels'. Fix: install fastops_kernels"
    )
    assert rows["cpu"]["status"] == "ok" and rows["rms_norm.torch"]["status"] == "ok"
    table = site.weft("plugins", "list", "--check")
    assert any(
        line.split()[:2] == ["ops", "rms_norm.fast"] and line.split()[-1] == "broken"
        for line in table.stdout.splitlines()
    )


def test_a_plugin_meant_for_an_unavailable_platform_is_a_doctor_warning_naming_that_platform(site):
    add_accel(site)
    doctor = site.weft("plugins", "doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert "warn  ops/rms_norm.accel (weft-accel 0.1.0) does not import: ModuleNotFoundError" in doctor.stdout
    assert (
        "fix: install the package that provides the module 'accel_runtime_xyz' (a dependency weft-accel does not "
        "declare), "
        "or use weft-accel on a machine where its platform 'accel' is available (here: throwaway)" in doctor.stdout
    )
    assert "no problems found (" in doctor.stdout  # a warning, not a problem
    checked = site.weft("plugins", "list", "--check")
    assert checked.returncode == 0, checked.stdout  # broken, but meant for a platform this machine lacks: as doctor
    assert any(
        line.split()[:2] == ["ops", "rms_norm.accel"] and line.split()[-1] == "broken"
        for line in checked.stdout.splitlines()
    )


def test_a_selected_plugin_that_does_not_import_gets_its_fix_in_doctor(site):
    add_fastops(site)
    doctor = site.weft("plugins", "doctor", "--set", "use.ops.rms_norm=fast")
    assert doctor.returncode == 1
    lines = doctor.stdout.splitlines()
    failed = next(index for index, line in enumerate(lines) if line.startswith("FAIL  use.ops.rms_norm = 'fast': "))
    assert "No module named 'fastops_kernels'" in lines[failed]
    assert lines[failed + 1].strip().startswith("fix: install fastops_kernels (pip install 'weft-fastops[kernels]'")
    assert "rms_norm.fast (weft-fastops 0.1.0) does not import" not in doctor.stdout  # reported once, as selected


def test_an_engine_start_logs_a_broken_plugin_nothing_selected_once_at_debug(site, tokenizer_files, tmp_path):
    """Two broken op plugins nobody selected: one meant for another platform, one that could have run here.
    An engine start (also with its core in a process of its own, as under ``weft serve``) logs each once, at
    DEBUG, and prints nothing about them at the default level; doctor is where they are reported."""
    from conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    add_accel(site)
    add_fastops(site)
    result = site.python(
        f"""
        import json, logging
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append((record.levelname, record.getMessage()))

        logging.getLogger("weft.plugins").addHandler(Keep())
        logging.getLogger("weft.plugins").setLevel(logging.DEBUG)
        from weft import LLM
        from weft.config import load_config
        from weft.engine.api.async_engine import AsyncEngine
        llm = LLM(model={str(model)!r}, engine={{"num_kv_blocks": 32}})
        print(llm.engine.worker.platform.name)
        engine = AsyncEngine(load_config(None, {{"model": {str(model)!r}, "engine": {{"num_kv_blocks": 32}}}}))
        engine.stop()  # its core process logged to stderr at INFO
        print(json.dumps([record for record in records if "failed to load" in record[1]]))
        """
    )
    assert result.returncode == 0, result.stderr
    platform, records = result.stdout.strip().splitlines()[-2:]
    assert platform == "cpu"
    accel = [(level, message) for level, message in json.loads(records) if "rms_norm.accel" in message]
    fast = [(level, message) for level, message in json.loads(records) if "rms_norm.fast" in message]
    assert [level for level, _ in accel] == ["DEBUG"], accel  # once in this process, for both engines
    assert "accel_runtime_xyz" in accel[0][1] and "meant for platform 'accel', not 'cpu'" in accel[0][1]
    assert [level for level, _ in fast] == ["DEBUG"], fast
    assert "No module named 'fastops_kernels'" in fast[0][1]
    assert "rms_norm.accel" not in result.stderr and "rms_norm.fast" not in result.stderr, result.stderr
