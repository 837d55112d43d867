"""`weft plugins freeze` and the lock every engine start verifies, against real throwaway distributions."""

from __future__ import annotations

import base64
import hashlib
import shutil
import socket
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import msgspec
import pytest

from conftest import Site, free_port, last_json, make_tiny_model
from weft import LLM, SamplingParams
from weft.config import ConfigError, load_config
from weft.plugins import PluginError
from weft.plugins.lock import LockedDistribution, NamedLock, freeze, installed_plugin_set


def start_engine(config_file: str | None = None) -> str:
    """Code that starts an engine on a model that does not exist, printing the PluginError it raises."""
    return f"""
        from weft import LLM
        from weft.config import load_config
        from weft.plugins import PluginError
        try:
            LLM(config=load_config({config_file!r}, {{"model": "/no/such/model"}}))
        except PluginError as error:
            print(error)
    """


def add(site, name, version="0.1.0", entry_points=None, record=None):
    module = name.replace("-", "_")
    site.add_distribution(
        name,
        version=version,
        entry_points=entry_points,
        modules={module: f"raise RuntimeError('{module} imported')\n"},  # freezing and verifying import nothing
    )
    if record is not None:
        (site.root / f"{module}-{version}.dist-info" / "RECORD").write_text(record)


def remove(site, name, version="0.1.0"):
    shutil.rmtree(site.root / f"{name.replace('-', '_')}-{version}.dist-info")


def test_a_lock_mismatch_refuses_to_start_naming_each_difference(site, tmp_path):
    add(site, "weft-alpha", entry_points={"weft.ops": {"rms_norm.alpha": "weft_alpha:AlphaRmsNorm"}})
    add(site, "weft-beta", entry_points={"weft.kv_connector": {"beta": "weft_beta:Beta"}})
    add(
        site,
        "weft-delta",
        entry_points={"weft.tokenizer": {"delta": "weft_delta:Old"}},
        record="weft_delta.py,sha256=aaa,10\n",
    )
    frozen = site.weft("plugins", "freeze")
    assert frozen.returncode == 0, frozen.stderr
    lock = tomllib.loads(frozen.stdout)
    locked = {dist["name"]: dist for dist in lock["distributions"]}
    assert locked["weft-alpha"]["version"] == "0.1.0" and locked["weft-alpha"]["core_api"] == ">=1.0,<2"
    assert locked["weft-alpha"]["entry_points"] == [
        {"slot": "ops", "name": "rms_norm.alpha", "target": "weft_alpha:AlphaRmsNorm"}
    ]
    assert len(locked["weft-delta"]["record_sha256"]) == 64
    assert {"weft-core", "weft-cuda", "weft-mooncake"} <= set(locked)  # the whole installed set, core included
    path = tmp_path / "weft.lock"
    path.write_text(frozen.stdout)
    assert "ok    plugin lock" in site.weft("plugins", "doctor", WEFT_PLUGINS_LOCK=str(path)).stdout

    remove(site, "weft-alpha")
    add(site, "weft-alpha", version="0.2.0", entry_points={"weft.ops": {"rms_norm.alpha": "weft_alpha:AlphaRmsNorm"}})
    remove(site, "weft-beta")
    add(site, "weft-gamma", entry_points={"weft.hooks": {"gamma": "weft_gamma"}})
    remove(site, "weft-delta")
    add(
        site,
        "weft-delta",
        entry_points={"weft.tokenizer": {"delta": "weft_delta:New"}},
        record="weft_delta.py,sha256=bbb,12\n",
    )
    expected = [
        "weft-alpha upgraded: locked 0.1.0, installed 0.2.0",
        "weft-beta 0.1.0 removed: locked, but not installed",
        "weft-delta 0.1.0 reinstalled from a different build",
        "weft-delta: entry point tokenizer 'delta' changed: locked weft_delta:Old, installed weft_delta:New",
        "weft-gamma 0.1.0 added: installed, but not in the lock",
    ]

    refused = site.python(start_engine(), WEFT_PLUGINS_LOCK=str(path))
    assert refused.returncode == 0, refused.stderr
    message = refused.stdout
    assert message.startswith(f"the installed plugins differ from the lock {path} (named by WEFT_PLUGINS_LOCK):")
    differences = [line.removeprefix("  - ") for line in message.splitlines() if line.startswith("  - ")]
    assert len(differences) == len(expected), differences
    for difference, start in zip(differences, expected, strict=False):
        assert difference.startswith(start), (difference, start)
    assert f"weft plugins freeze > {path}" in message
    assert "/no/such/model" not in message  # refused before anything else

    # The same lock named in weft.toml as the issue spells it, relative to that file, from another working directory.
    (tmp_path / "weft.toml").write_text('[plugins]\nlock = "weft.lock"\n')
    config = site.python(start_engine(str(tmp_path / "weft.toml")))
    assert config.stdout.startswith(f"the installed plugins differ from the lock {path} (named by [plugins] lock"), (
        config.stdout
    )
    doctor = site.weft("plugins", "doctor", "--config", str(tmp_path / "weft.toml"))
    assert doctor.returncode == 1
    assert all(f"  - {start}" in doctor.stdout for start in expected), doctor.stdout

    # Accepting the installed set: freeze again, and the engine gets past the lock (to the missing model).
    path.write_text(site.weft("plugins", "freeze").stdout)
    accepted = site.python(start_engine(), WEFT_PLUGINS_LOCK=str(path))
    assert "differ from the lock" not in accepted.stdout + accepted.stderr and "/no/such/model" in accepted.stderr


def test_freeze_imports_no_plugin_and_no_torch(site):
    add(site, "weft-alpha", entry_points={"weft.ops": {"rms_norm.alpha": "weft_alpha:AlphaRmsNorm"}})
    result = site.python(
        """
        import io, json, sys, contextlib
        from weft.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["plugins", "freeze"])
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("torch", "weft_alpha", "weft_cuda", "weft_mooncake")
                       or m.startswith("weft.builtins"))
        print(json.dumps({"code": code, "heavy": heavy}))
        """
    )
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout) == {"code": 0, "heavy": []}


def test_a_missing_or_foreign_lock_is_refused_naming_the_file(tmp_path):
    missing = tmp_path / "missing.lock"
    with pytest.raises(PluginError, match=f"plugin lock {missing}: cannot read it .*weft plugins freeze > {missing}"):
        LLM(config=load_config(None, {"plugins.lock": str(missing)}))
    foreign = tmp_path / "foreign.lock"
    foreign.write_text('[tool.poetry]\nname = "x"\n')
    with pytest.raises(PluginError, match=f"plugin lock {foreign}: not a lock written by `weft plugins freeze`"):
        LLM(config=load_config(None, {"plugins_lock": str(foreign)}))


def test_an_engine_starts_and_runs_when_the_installed_set_matches_the_lock(tmp_path, tokenizer_files, monkeypatch):
    model = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    lock = tmp_path / "weft.lock"
    lock.write_text(freeze())
    monkeypatch.setenv("WEFT_PLUGINS_LOCK", str(lock))
    llm = LLM(model=str(model), engine={"num_kv_blocks": 32})
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(output[0].outputs[0].token_ids) == 2


def test_weft_toml_names_the_lock_in_the_plugins_table_and_config_show_prints_it_there(site, tmp_path):
    (tmp_path / "weft.lock").write_text(freeze())
    weft_toml = tmp_path / "weft.toml"
    weft_toml.write_text('[plugins]\nlock = "weft.lock"\n')
    expected = str(tmp_path / "weft.lock")
    assert load_config(weft_toml).plugins_lock == expected  # next to the file, not in the working directory
    assert load_config(weft_toml, {"plugins": {}}).plugins_lock == expected  # replacing the plugin tables keeps it
    assert load_config(weft_toml, {"plugins.lock": "/elsewhere.lock"}).plugins_lock == "/elsewhere.lock"
    assert load_config(weft_toml).plugins == {}  # the lock is no plugin's options table
    (tmp_path / "old.toml").write_text('plugins_lock = "weft.lock"\n')  # the older spelling is still read
    assert load_config(tmp_path / "old.toml").plugins_lock == expected
    (tmp_path / "both.toml").write_text('plugins_lock = "a.lock"\n[plugins]\nlock = "b.lock"\n')
    with pytest.raises(ConfigError, match=r"both.toml: plugins.lock and plugins_lock both name the plugin lock"):
        load_config(tmp_path / "both.toml")
    (tmp_path / "table.toml").write_text("[plugins.lock]\nthreads = 2\n")
    with pytest.raises(ConfigError, match=r'table.toml: plugins.lock: expected str .*got dict .*plugins."<slot>.lock"'):
        load_config(tmp_path / "table.toml")

    shown = site.weft("config", "show", "--config", str(weft_toml))
    assert shown.returncode == 0, shown.stderr
    assert tomllib.loads(shown.stdout)["plugins"]["lock"] == expected, shown.stdout
    as_json = site.weft("config", "show", "--json", "--config", str(weft_toml))
    assert last_json(as_json.stdout)["plugins"]["lock"] == expected
    (tmp_path / "empty").mkdir()
    unset = site.weft("config", "show", cwd=tmp_path / "empty")
    assert "[plugins]\n# lock: unset (lock file from `weft plugins freeze`" in unset.stdout, unset.stdout


def stale_lock(site: Site, path: Path) -> str:
    """A lock of what is installed now, made stale by installing one more plugin; returns the difference's start."""
    path.write_text(freeze())
    add(site, "weft-alpha", entry_points={"weft.ops": {"rms_norm.alpha": "weft_alpha:AlphaRmsNorm"}})
    return (
        f"the installed plugins differ from the lock {path} (named by WEFT_PLUGINS_LOCK):\n  - weft-alpha 0.1.0 added"
    )


@pytest.mark.parametrize("command", [["serve", "--model"], ["generate", "hello", "--model"], ["verify"]])
def test_serve_generate_and_verify_check_the_lock_before_the_model(site, tmp_path, command):
    refusal = stale_lock(site, tmp_path / "weft.lock")
    result = site.weft(*command, "/no/such/model", WEFT_PLUGINS_LOCK=str(tmp_path / "weft.lock"))
    assert result.returncode == 1
    assert result.stderr.startswith(f"weft: error: {refusal}"), result.stderr
    assert "/no/such/model" not in result.stderr


def test_the_launcher_of_another_node_checks_its_own_installation_before_it_waits_for_node_0(site, tmp_path):
    refusal = stale_lock(site, tmp_path / "weft.lock")
    result = site.weft(
        "serve",
        "--model",
        "/no/such/model",
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--set",
        "engine.distributed.worker_timeout=5",
        WEFT_PLUGINS_LOCK=str(tmp_path / "weft.lock"),
    )  # no node 0 runs: a launcher that got past the lock would wait for it, then fail to reach it
    assert result.returncode == 1
    assert result.stderr.startswith(f"weft: error: {refusal}"), result.stderr
    assert "waiting for node 0" not in result.stderr


def test_a_ray_actor_checks_its_own_machine_against_the_lock_the_engine_read():
    executor = pytest.importorskip("weft_ray.executor")
    from weft.distributed.rendezvous import StoreAddress
    from weft.resolve import parallel_layout

    installed = installed_plugin_set()
    elsewhere = LockedDistribution(
        name="weft-omega", version="1.0.0", core_api=">=1.0,<2", record_sha256="", entry_points=[]
    )
    lock = NamedLock(
        path="/on/the/engine/machine/weft.lock",
        source="WEFT_PLUGINS_LOCK",  # no such file here
        lock=msgspec.structs.replace(installed, distributions=[*installed.distributions, elsewhere]),
    )
    config = load_config(None, {"engine.tensor_parallel_size": 2})
    nowhere = StoreAddress("127.0.0.1", free_port(), "weft-test", 1.0)  # past the lock, the actor would fail here
    with pytest.raises(PluginError) as refused:
        executor.RayWorker().start(config, parallel_layout(config, rank=1), nowhere, lock)
    assert str(refused.value).startswith(
        f"the installed plugins on {socket.gethostname()} (Ray worker rank 1) differ from the lock "
        f"/on/the/engine/machine/weft.lock (named by WEFT_PLUGINS_LOCK):\n  - weft-omega 1.0.0 removed"
    ), refused.value


def build_wheel(
    folder: Path, name: str, files: dict[str, str], entry_points: str = "", requires: tuple[str, ...] = ()
) -> Path:
    """A pure-Python wheel as a build backend writes it (files, METADATA, WHEEL, entry_points.txt, RECORD)."""
    dist_info = f"{name.replace('-', '_')}-0.1.0.dist-info"
    requirements = "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n{requirements}"
    contents = {
        **files,
        f"{dist_info}/METADATA": metadata,
        f"{dist_info}/entry_points.txt": entry_points,
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in contents.items())
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name.replace('-', '_')}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in {**contents, f"{dist_info}/RECORD": record + f"{dist_info}/RECORD,,\n"}.items():
            archive.writestr(path, text)
    return wheel


def pip_install(site: Site, *arguments: str) -> str:
    """pip installs into ``site`` (offline); returns the RECORD pip wrote for weft-eta."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(site.root),
            *arguments,
        ],
        check=True,
        timeout=120,
    )
    return (site.root / "weft_eta-0.1.0.dist-info" / "RECORD").read_text()


def test_the_same_build_installed_from_another_checkout_or_as_a_dependency_matches_the_lock(tmp_path):
    """The RECORD hash is the build's: pip's direct_url.json (the checkout's path) and REQUESTED differ between
    these two installs of one wheel, and neither is a difference (nor the bytecode pip compiles); a changed module
    is."""
    entry_points = "[weft.hooks]\neta = weft_eta\n[console_scripts]\nweft-eta = weft_eta:main\n"
    first, second, rebuilt = tmp_path / "checkout-a", tmp_path / "checkout-b", tmp_path / "checkout-c"
    wheel = build_wheel(first, "weft-eta", {"weft_eta/__init__.py": "def main():\n    pass\n"}, entry_points)
    shutil.copytree(first, second)
    build_wheel(second, "weft-eta-app", {"weft_eta_app.py": ""}, requires=("weft-eta",))
    rebuilt_wheel = build_wheel(
        rebuilt, "weft-eta", {"weft_eta/__init__.py": "def main():\n    return 1\n"}, entry_points
    )

    requested, dependency, changed = Site(tmp_path / "site-a"), Site(tmp_path / "site-b"), Site(tmp_path / "site-c")
    record_a = pip_install(requested, "--no-deps", str(wheel))
    record_b = pip_install(dependency, "--find-links", str(second), "weft-eta-app")
    pip_install(changed, "--no-deps", str(rebuilt_wheel))
    assert "direct_url.json" in record_a and "REQUESTED" in record_a and "__pycache__" in record_a
    assert "direct_url.json" not in record_b and "REQUESTED" not in record_b  # pulled in by weft-eta-app

    lock = tmp_path / "weft.lock"
    lock.write_text(requested.weft("plugins", "freeze").stdout)

    def frozen_eta(text: str) -> dict:
        return next(dist for dist in tomllib.loads(text)["distributions"] if dist["name"] == "weft-eta")

    locked = frozen_eta(lock.read_text())
    assert frozen_eta(dependency.weft("plugins", "freeze").stdout) == locked
    assert frozen_eta(changed.weft("plugins", "freeze").stdout)["record_sha256"] != locked["record_sha256"]
    accepted = dependency.python(start_engine(), WEFT_PLUGINS_LOCK=str(lock))
    assert "differ from the lock" not in accepted.stdout + accepted.stderr and "/no/such/model" in accepted.stderr
