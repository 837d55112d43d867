"""weft.toml loading and validation, through the Python API and the `weft config show` command."""

from __future__ import annotations

import pytest

from conftest import last_json
from weft.config import ConfigError, WeftConfig, load_config, parse_override


def write(tmp_path, text: str):
    path = tmp_path / "weft.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_documented_shape():
    config = load_config()
    assert isinstance(config, WeftConfig)
    assert config.model == "smollm2-135m-instruct"
    assert (config.use.platform, config.use.attention, config.use.loader, config.use.tokenizer) == ("auto",) * 4
    assert config.use.kv_connector == "none"


def test_file_values_and_overrides(tmp_path):
    path = write(tmp_path, 'model = "/models/x"\n[engine]\nmax_num_seqs = 8\nblock_size = 32\n[server]\nport = 9000\n')
    config = load_config(path, {"engine.max_num_seqs": 4, "server": {"host": "0.0.0.0"}})
    assert config.model == "/models/x"
    assert config.engine.max_num_seqs == 4  # the override wins over the file
    assert config.engine.block_size == 32  # the file wins over the default
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[engine]\nmax_num_seqs = "lots"\n', "weft.toml: engine.max_num_seqs: expected int, got str 'lots'"),
        ("[engine]\nmax_num_seqs = 0\n", "weft.toml: engine.max_num_seqs: expected int >= 1, got int 0"),
        ("[engine]\nmax_num_seq = 3\n", "weft.toml: engine.max_num_seq: unknown key; did you mean 'max_num_seqs'?"),
        ('modle = "x"\n', "weft.toml: modle: unknown key; did you mean 'model'?"),
        (
            '[engine]\ndtype = "fp8"\n',
            "weft.toml: engine.dtype: expected one of 'auto', 'float32', 'float16', 'bfloat16', got 'fp8'",
        ),
        ("[server]\nport = 70000\n", "weft.toml: server.port: expected int <= 65535, got int 70000"),
        ("engine = 3\n", "weft.toml: engine: expected object, got int 3"),
        ("[engine\n", "weft.toml: not valid TOML"),
    ],
)
def test_errors_name_file_key_path_and_expected_type(tmp_path, text, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    assert str(caught.value).startswith(str(tmp_path / expected.split(":")[0])), str(caught.value)
    assert expected.split(":", 1)[1] in str(caught.value)


def test_override_errors_name_the_override():
    with pytest.raises(ConfigError, match=r"^override: engine.max_num_seqs: expected int, got str 'x'"):
        load_config(None, {"engine.max_num_seqs": "x"})


def test_parse_override_reads_toml_literals():
    assert parse_override("engine.max_num_seqs=8") == ("engine.max_num_seqs", 8)
    assert parse_override("engine.enable_prefix_caching=false") == ("engine.enable_prefix_caching", False)
    assert parse_override("model=/tmp/model dir") == ("model", "/tmp/model dir")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("engine.max_num_seqs")


def test_config_show_exits_non_zero_with_the_key_path(site, tmp_path):
    bad_type = write(tmp_path, '[engine]\nmax_num_seqs = "lots"\n')
    result = site.weft("config", "show", "--config", str(bad_type))
    assert result.returncode == 1
    assert "engine.max_num_seqs: expected int, got str 'lots'" in result.stderr
    unknown = write(tmp_path, "[server]\nprot = 1\n")
    result = site.weft("config", "show", "--config", str(unknown))
    assert result.returncode == 1 and "server.prot: unknown key; did you mean 'port'?" in result.stderr


def test_config_show_prints_the_effective_config(site, tmp_path):
    (tmp_path / "weft.toml").write_text('[engine]\nmax_num_seqs = 8\n[server]\napi_key = "secret"\n')
    result = site.weft(
        "config", "show", "--json", "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    shown = last_json(result.stdout)
    assert shown["engine"]["max_num_seqs"] == 8  # ./weft.toml is read when present
    assert shown["engine"]["max_num_batched_tokens"] == 512
    assert shown["engine"]["enable_prefix_caching"] is False
    assert shown["server"]["api_key"] == "***"
    toml = site.weft("config", "show", "--set", "server.port=9001", cwd=tmp_path)
    assert "port = 9001" in toml.stdout and "secret" not in toml.stdout


def test_plugin_tables_are_validated_against_the_plugin_options(site, tmp_path):
    site.add_distribution(
        "weft-opts",
        entry_points={
            "weft.kv_connector": {"store": "store_impl:Store"},
            "weft.platform": {"plain": "plain_impl:Plain"},
        },
        modules={
            "store_impl": """
                import msgspec
                from weft.contracts.kv_connector import KVConnector

                class StoreOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                    master: str
                    segment_bytes: int = 1024

                class Store(KVConnector):
                    name = "store"
                    Options = StoreOptions
            """,
            "plain_impl": "from weft.builtins.cpu import CpuPlatform as Plain\n",
        },
    )
    cases = {
        '[plugins.store]\nmaster = "h:1"\nsegment_bytes = "big"\n': "plugins.store.segment_bytes: expected int, got "
        "str 'big'",
        "[plugins.store]\nsegment_bytes = 1\n": "plugins.store: object missing required field master",
        '[plugins.store]\nmaster = "h:1"\nbogus = 1\n': "plugins.store.bogus: unknown key",
        "[plugins.nothere]\nx = 1\n": "plugins.nothere: no installed plugin is named 'nothere'",
        "[plugins.plain]\nx = 1\n": "plugins.plain: plugin 'plain' takes no options",
    }
    for text, expected in cases.items():
        result = site.weft("config", "show", "--config", str(write(tmp_path, text)))
        assert result.returncode == 1, text
        assert expected in result.stderr, (text, result.stderr)
    good = site.weft("config", "show", "--json", "--config", str(write(tmp_path, '[plugins.store]\nmaster = "h:1"\n')))
    assert good.returncode == 0, good.stderr
    assert last_json(good.stdout)["plugins"]["store"] == {"master": "h:1", "segment_bytes": 1024}


def test_config_show_prints_every_installed_plugins_options_with_their_defaults(site, tmp_path):
    site.add_distribution(
        "weft-cache-opts",
        entry_points={"weft.kv_connector": {"cachey": "cachey_impl:Cachey"}},
        modules={
            "cachey_impl": """
                from typing import Annotated
                import msgspec
                from weft.contracts.kv_connector import KVConnector

                class CacheyOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                    path: Annotated[
                        str | None, msgspec.Meta(description="where blocks go; default: a temporary folder")
                    ] = None
                    max_bytes: int = 1 << 20

                class Cachey(KVConnector):
                    name = "cachey"
                    Options = CacheyOptions
            """,
        },
    )
    result = site.weft("config", "show", cwd=tmp_path)  # no [plugins.cachey] table anywhere
    assert result.returncode == 0, result.stderr
    table = result.stdout[result.stdout.index("[plugins.cachey]") :].split("\n\n")[0].splitlines()
    assert table == [
        "[plugins.cachey]",
        "# path: unset (where blocks go; default: a temporary folder)",
        "max_bytes = 1048576",
    ], table
    shown = last_json(site.weft("config", "show", "--json", cwd=tmp_path).stdout)
    assert shown["plugins"]["cachey"] == {"path": None, "max_bytes": 1048576}
    assert last_json(site.weft("config", "show", "--json", cwd=tmp_path).stdout)["plugins"]["lock"] is None


def test_errors_blame_the_right_source(site, tmp_path):
    path = write(tmp_path, "[server]\nporta = 1\n")
    result = site.weft("config", "show", "--config", str(path), "--port", "9000")
    assert f"{path}: server.porta: unknown key" in result.stderr, result.stderr
    result = site.weft(
        "config", "show", "--config", str(write(tmp_path, "[plugins.bytes]\n")), "--set", "plugins.bytes.add_bos=7"
    )
    assert "override: plugins.bytes.add_bos: expected bool, got int 7" in result.stderr, result.stderr


def test_text_flags_stay_text(site):
    result = site.weft("config", "show", "--json", "--api-key", "12345", "--host", "10", "--set", "server.port=8001")
    assert result.returncode == 0, result.stderr
    shown = last_json(result.stdout)
    assert shown["server"]["host"] == "10" and shown["server"]["port"] == 8001


def test_a_name_shared_by_two_slots_needs_a_qualified_table(site, tmp_path):
    site.add_distribution(
        "weft-dual",
        entry_points={"weft.platform": {"dual": "dual_impl:P"}, "weft.kv_connector": {"dual": "dual_impl:C"}},
        modules={
            "dual_impl": """
                import msgspec
                from weft.builtins.cpu import CpuPlatform
                from weft.contracts.kv_connector import KVConnector

                class P(CpuPlatform):
                    class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                        threads: int = 1

                class C(KVConnector):
                    class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
                        master: str = ""
            """
        },
    )
    ambiguous = site.weft("config", "show", "--set", "plugins.dual.threads=4")
    assert ambiguous.returncode == 1 and '[plugins."platform.dual"]' in ambiguous.stderr
    qualified = site.weft("config", "show", "--json", "--set", 'plugins."platform.dual".threads=4')
    assert qualified.returncode == 0, qualified.stderr
    plugins = last_json(qualified.stdout)["plugins"]
    assert plugins["platform.dual"] == {"threads": 4}
    assert plugins["kv_connector.dual"] == {"master": ""}  # the other one's defaults, under its qualified name


def test_config_show_prints_every_key_and_marks_the_unset_ones(site, tmp_path):
    import tomllib

    toml = site.weft("config", "show", "--set", "engine.max_model_len=256", cwd=tmp_path)
    assert toml.returncode == 0, toml.stderr
    shown = tomllib.loads(toml.stdout)  # the output stays valid TOML
    comments: dict[str, list[str]] = {}
    table = ""
    for line in toml.stdout.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif line.startswith("# ") and ": unset" in line:
            comments.setdefault(table, []).append(line)
    everything = last_json(
        site.weft("config", "show", "--json", "--set", "engine.max_model_len=256", cwd=tmp_path).stdout
    )
    unset = 0
    for name in ("", "engine", "server", "plugins"):
        section = everything[name] if name else everything
        for key, value in section.items():
            if value is None:  # TOML has no null: a comment naming the key and what leaving it unset means
                unset += 1
                assert any(line.startswith(f"# {key}: unset (") for line in comments.get(name, [])), (name, key)
            elif not isinstance(value, dict):  # tables are compared key by key on their own
                assert (shown[name] if name else shown)[key] == value, (name, key)
    assert unset >= 4 and everything["server"]["api_key"] is None and everything["plugins"]["lock"] is None
    assert shown["engine"]["max_model_len"] == 256


def test_config_show_prints_the_values_the_engine_derives(site, tmp_path):
    """Options whose default follows from others (or from the platform) show the value the engine runs with."""
    one = last_json(site.weft("config", "show", "--json", "--max-num-batched-tokens", "1000", cwd=tmp_path).stdout)[
        "engine"
    ]
    assert one["distributed_executor_backend"] == "uniproc"
    assert one["long_prefill_token_threshold"] == 250
    assert one["graph_batch_sizes"] == []  # the CPU platform captures no graphs
    assert (one["max_num_seqs"], one["max_num_batched_tokens"], one["async_scheduling"]) == (64, 1000, False)
    two = last_json(
        site.weft("config", "show", "--json", "--set", "engine.tensor_parallel_size=2", cwd=tmp_path).stdout
    )
    assert two["engine"]["distributed_executor_backend"] == "mp"


def test_options_that_would_do_nothing_on_one_rank_are_refused(tmp_path):
    for table, value in (("nnodes", 2), ("node_rank", 1), ("master_addr", "10.0.0.2"), ("master_port", 29600)):
        with pytest.raises(
            ConfigError,
            match=rf"engine.distributed.{table} = .* but tensor_parallel_size x "
            rf"pipeline_parallel_size = 1 x 1 = 1 ranks: .*raise tensor_parallel_size",
        ):
            load_config(None, {"engine": {"distributed": {table: value}}})
    # One node of rank 0 says what a single process is anyway; a real layout takes them all.
    load_config(None, {"engine": {"distributed": {"nnodes": 1, "node_rank": 0}}})
    load_config(
        None, {"engine": {"tensor_parallel_size": 2, "distributed": {"nnodes": 2, "node_rank": 1, "master_addr": "h"}}}
    )


def test_config_show_refuses_a_use_name_no_plugin_has_with_doctors_message(site, tmp_path):
    site.add_distribution(
        "weft-diskstore",
        entry_points={"weft.kv_connector": {"diskstore": "diskstore_impl:DiskStore"}},
        modules={"diskstore_impl": "raise RuntimeError('config show imported the plugin')\n"},
    )
    write(tmp_path, '[use]\nkv_connector = "diskstor"\n')
    show = site.weft("config", "show", cwd=tmp_path)
    assert show.returncode == 1
    [message] = [
        line.removeprefix("weft: error: ") for line in show.stderr.splitlines() if line.startswith("weft: error: ")
    ]
    assert message.startswith(
        "use.kv_connector = 'diskstor': no kv_connector plugin named 'diskstor' is installed; available: "
    )
    assert message.endswith("did you mean 'diskstore'?")
    doctor = site.weft("plugins", "doctor", cwd=tmp_path)
    assert doctor.returncode == 1 and f"FAIL  {message}" in doctor.stdout
    typo_in_ops = site.weft("config", "show", "--set", "use.ops.rms_norm=trch", cwd=tmp_path)
    assert "use.ops.rms_norm = 'trch': no ops plugin named 'rms_norm.trch'" in typo_in_ops.stderr
    assert "did you mean 'rms_norm.torch'?" in typo_in_ops.stderr
    write(tmp_path, '[use]\nkv_connector = "diskstore"\n')
    fixed = site.weft("config", "show", "--json", cwd=tmp_path)  # names are checked from metadata: nothing imported
    assert fixed.returncode == 0, fixed.stderr
    assert last_json(fixed.stdout)["use"]["kv_connector"] == "diskstore"


def test_fill_processes_without_a_fill_process_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"engine.structured_output_fill_processes = 2 but engine.structured_output_fill = "
        r"'thread' fills on a thread of the engine core.*set structured_output_fill to 'process'",
    ):
        load_config(None, {"engine": {"structured_output_fill": "thread", "structured_output_fill_processes": 2}})
    config = load_config(None, {"engine": {"structured_output_fill_processes": 2}})
    assert config.engine.structured_output_fill == "auto" and config.engine.structured_output_fill_processes == 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"engine": {"enforce_eager": True, "graph_batch_sizes": [1, 2]}},
            r"engine.graph_batch_sizes = \[1, 2\] but engine.enforce_eager = true captures no graphs; remove "
            r"graph_batch_sizes",
        ),
        (
            {"engine": {"num_kv_blocks": 64, "cpu_kv_cache_bytes": 1 << 20}},
            r"engine.cpu_kv_cache_bytes = 1048576 sizes the KV cache, but engine.num_kv_blocks = 64 sets its size; "
            r"keep one",
        ),
        (
            {"engine": {"num_kv_blocks": 64, "gpu_memory_utilization": 0.5}},
            r"engine.gpu_memory_utilization = 0.5 sizes the KV cache, but engine.num_kv_blocks = 64 sets its size",
        ),
        (
            {"engine": {"enable_chunked_prefill": False, "long_prefill_token_threshold": 128}},
            r"engine.long_prefill_token_threshold = 128 paces long prefills .* but engine.enable_chunked_prefill = "
            r"false",
        ),
        (
            {"engine": {"enable_chunked_prefill": False, "max_long_partial_prefills": 2}},
            r"engine.max_long_partial_prefills = 2 paces long prefills",
        ),
        (
            {"use": {"structured_output": "none"}, "engine": {"structured_output_fill": "process"}},
            r"engine.structured_output_fill = 'process' but use.structured_output = 'none' turns structured outputs "
            r"off",
        ),
        (
            {"use": {"structured_output": "none"}, "engine": {"structured_output_fill_processes": 2}},
            r"engine.structured_output_fill_processes = 2 but use.structured_output = 'none'",
        ),
        (
            {"engine": {"distributed": {"worker_timeout": 30}}},
            r"engine.distributed.worker_timeout = 30 but the uniproc executor runs its one worker in the engine "
            r"core's process",
        ),
        (
            {"engine": {"revision": "v2"}},
            r"engine.revision = 'v2' applies to a Hugging Face repo id \(org/name\), but model = "
            r"'smollm2-135m-instruct' is not one",
        ),
        (
            {"model": ".", "engine": {"download_dir": "/tmp/hub"}},
            r"engine.download_dir = '/tmp/hub' applies to a Hugging Face repo id .* model = '.' is not one",
        ),
    ],
)
def test_an_option_another_makes_do_nothing_is_refused(overrides, expected):
    """Each option here would be silently dropped beside the other one the message names."""
    with pytest.raises(ConfigError, match=rf"^override: {expected}"):
        load_config(None, overrides)


def test_a_file_that_spells_out_the_defaults_is_accepted(site, tmp_path):
    """What ``config show`` prints (every key, derived ones too) loads back, with these options set alike."""
    for flags in (
        [],
        ["--num-kv-blocks", "64"],
        ["--enforce-eager"],
        ["--no-enable-chunked-prefill"],
        ["--structured-output", "none"],
    ):
        shown = site.weft("config", "show", *flags, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        write(tmp_path, shown.stdout)
        again = site.weft("config", "show", cwd=tmp_path)
        assert again.returncode == 0, (flags, again.stderr)
        (tmp_path / "weft.toml").unlink()


def test_options_that_take_effect_beside_each_other_are_accepted():
    load_config(None, {"engine": {"graph_batch_sizes": [1, 2], "num_kv_blocks": 64}})
    load_config(None, {"engine": {"enable_chunked_prefill": True, "long_prefill_token_threshold": 128}})
    load_config(None, {"engine": {"distributed_executor_backend": "mp", "distributed": {"worker_timeout": 30}}})
    load_config(None, {"engine": {"tensor_parallel_size": 2, "distributed": {"worker_timeout": 30}}})
    load_config(None, {"model": "org/name", "engine": {"revision": "v2", "download_dir": "/tmp/hub"}})


def test_a_selected_plugin_missing_its_required_options_is_named_with_its_table():
    """``[use] kv_connector = "disk"`` without a ``[plugins.disk]`` table: the engine's error and ``weft config show``
    name the table and the missing key, not only msgspec's field."""
    from weft.plugins import PluginRegistry
    from weft.resolve import option_problems

    registry = PluginRegistry()
    config = load_config(None, {"use": {"kv_connector": "disk"}}, registry=registry)
    [problem] = option_problems(config, registry)
    assert problem == (
        "use.kv_connector = 'disk': config: plugins.disk: object missing required field path "
        "(there is no [plugins.disk] table: add one that sets it)"
    )
    assert (
        option_problems(
            load_config(
                None, {"use": {"kv_connector": "disk"}, "plugins": {"disk": {"path": "/tmp/x"}}}, registry=registry
            ),
            registry,
        )
        == []
    )


def test_list_and_table_options_have_flags_too(site, tmp_path):
    """Every option of [use] and [engine] has a flag: lists take comma-separated values, a table one KEY=VALUE a flag,
    added to the file's table."""
    write(tmp_path, '[use.ops]\nrms_norm = "torch"\n')
    shown = site.weft(
        "config",
        "show",
        "--json",
        "--graph-batch-sizes",
        "1,2, 4",
        "--pipeline-partition",
        "3",
        "--ops",
        "silu_and_mul=torch",
        "--ops",
        "bitmask_argmax=torch",
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr
    data = last_json(shown.stdout)
    assert data["engine"]["graph_batch_sizes"] == [1, 2, 4] and data["engine"]["pipeline_partition"] == [3]
    assert data["use"]["ops"] == {"rms_norm": "torch", "silu_and_mul": "torch", "bitmask_argmax": "torch"}
    wrong = site.weft("config", "show", "--ops", "rms_norm", cwd=tmp_path)
    assert wrong.returncode == 1 and "--ops 'rms_norm': expected KEY=VALUE" in wrong.stderr
    not_ints = site.weft("config", "show", "--graph-batch-sizes", "1,many", cwd=tmp_path)
    assert not_ints.returncode == 1 and "engine.graph_batch_sizes.1: expected int, got str 'many'" in not_ints.stderr, (
        not_ints.stderr
    )
