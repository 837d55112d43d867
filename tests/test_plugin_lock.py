"""`weft plugins freeze` and the lock every engine start verifies, against real throwaway distributions."""

from __future__ import annotations

import shutil
import tomllib

import pytest
from conftest import last_json, make_tiny_model

from weft import LLM, SamplingParams
from weft.config import load_config
from weft.plugins import PluginError

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
        name, version=version, entry_points=entry_points,
        modules={module: f"raise RuntimeError('{module} imported')\n"},  # freezing and verifying import nothing
    )
    if record is not None:
        (site.root / f"{module}-{version}.dist-info" / "RECORD").write_text(record)


def remove(site, name, version="0.1.0"):
    shutil.rmtree(site.root / f"{name.replace('-', '_')}-{version}.dist-info")


def test_a_lock_mismatch_refuses_to_start_naming_each_difference(site, tmp_path):
    add(site, "weft-alpha", entry_points={"weft.ops": {"rms_norm.alpha": "weft_alpha:AlphaRmsNorm"}})
    add(site, "weft-beta", entry_points={"weft.kv_connector": {"beta": "weft_beta:Beta"}})
    add(site, "weft-delta", entry_points={"weft.tokenizer": {"delta": "weft_delta:Old"}}, record="weft_delta.py,sha256=aaa,10\n")
    frozen = site.weft("plugins", "freeze")
    assert frozen.returncode == 0, frozen.stderr
    lock = tomllib.loads(frozen.stdout)
    locked = {dist["name"]: dist for dist in lock["distributions"]}
    assert locked["weft-alpha"]["version"] == "0.1.0" and locked["weft-alpha"]["core_api"] == ">=1.0,<2"
    assert locked["weft-alpha"]["entry_points"] == [{"slot": "ops", "name": "rms_norm.alpha", "target": "weft_alpha:AlphaRmsNorm"}]
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
    add(site, "weft-delta", entry_points={"weft.tokenizer": {"delta": "weft_delta:New"}}, record="weft_delta.py,sha256=bbb,12\n")
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
    for difference, start in zip(differences, expected):
        assert difference.startswith(start), (difference, start)
    assert f"weft plugins freeze > {path}" in message
    assert "/no/such/model" not in message  # refused before anything else

    # The same lock named in weft.toml, relative to that file, from another working directory.
    (tmp_path / "weft.toml").write_text('plugins_lock = "weft.lock"\n')
    config = site.python(start_engine(str(tmp_path / "weft.toml")))
    assert config.stdout.startswith(f"the installed plugins differ from the lock {path} (named by plugins_lock"), config.stdout
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
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "weft_alpha", "weft_cuda", "weft_mooncake")
                       or m.startswith("weft.builtins"))
        print(json.dumps({"code": code, "heavy": heavy}))
        """
    )
    assert result.returncode == 0, result.stderr
    assert last_json(result.stdout) == {"code": 0, "heavy": []}


def test_a_missing_or_foreign_lock_is_refused_naming_the_file(tmp_path):
    missing = tmp_path / "missing.lock"
    with pytest.raises(PluginError, match=f"plugin lock {missing}: cannot read it .*weft plugins freeze > {missing}"):
        LLM(config=load_config(None, {"plugins_lock": str(missing)}))
    foreign = tmp_path / "foreign.lock"
    foreign.write_text('[tool.poetry]\nname = "x"\n')
    with pytest.raises(PluginError, match=f"plugin lock {foreign}: not a lock written by `weft plugins freeze`"):
        LLM(config=load_config(None, {"plugins_lock": str(foreign)}))


def test_an_engine_starts_and_runs_when_the_installed_set_matches_the_lock(tmp_path, tokenizer_files, monkeypatch):
    from weft.plugins.lock import freeze

    model = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    lock = tmp_path / "weft.lock"
    lock.write_text(freeze())
    monkeypatch.setenv("WEFT_PLUGINS_LOCK", str(lock))
    llm = LLM(model=str(model), engine={"num_kv_blocks": 32})
    output = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert len(output[0].outputs[0].token_ids) == 2
