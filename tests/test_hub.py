"""Hugging Face repo ids download through huggingface_hub from a local server speaking the Hub's protocol
(HF_ENDPOINT)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from hub_server import HubServer, Repo
from weft.builtins.safetensors_loader import SafetensorsLoader
from weft.config import load_config
from weft.contracts.loader import LoadConfig
from weft.plugins import PluginRegistry
from weft.resolve import load_config_for, load_tokenizer, resolve_source

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 16,
}


def shard_bytes(seed: int, names: list[str]) -> tuple[bytes, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(4, 8, generator=generator) for name in names}
    return save(tensors), tensors


def model_files(
    seed: int, tokenizer_files: Path, chat_template: str
) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """A sharded checkpoint, its metadata and tokenizer, and files a model does not need."""
    first, tensors_1 = shard_bytes(seed, ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"])
    second, tensors_2 = shard_bytes(seed + 100, ["lm_head.weight"])
    weight_map = {name: "model-00001-of-00002.safetensors" for name in tensors_1}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in tensors_2}
    tokenizer_config = json.loads((tokenizer_files / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = chat_template
    files = {
        "config.json": json.dumps(CONFIG).encode(),
        "generation_config.json": json.dumps({"temperature": 0.5}).encode(),
        "tokenizer.json": (tokenizer_files / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": json.dumps(tokenizer_config).encode(),
        "model.safetensors.index.json": json.dumps({"metadata": {}, "weight_map": weight_map}).encode(),
        "model-00001-of-00002.safetensors": first,
        "model-00002-of-00002.safetensors": second,
        # Not needed: a consolidated twin, PyTorch pickles, the original checkpoint, a GGUF, the card.
        "consolidated.safetensors": save({"everything": torch.zeros(2)}),
        "pytorch_model.bin": b"pickle",
        "original/params.json": b"{}",
        "model-Q4.gguf": b"GGUF",
        "README.md": b"# tiny",
    }
    return files, tensors_1 | tensors_2


NEEDED = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "model.safetensors.index.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
}


@pytest.fixture(scope="module")
def hub(tokenizer_files):
    server = HubServer()
    files_a, tensors_a = model_files(0, tokenizer_files, "A:{{ messages[0]['content'] }}")
    files_b, tensors_b = model_files(1, tokenizer_files, "B:{{ messages[0]['content'] }}")
    repo = Repo()
    repo.add_commit(COMMIT_A, files_a, "main")
    repo.add_commit(COMMIT_B, files_b, "v1")
    server.repos["org/tiny"] = repo
    gated = Repo(token="hf_secret")
    gated.add_commit(COMMIT_A, files_a, "main")
    server.repos["org/gated"] = gated
    server.tensors = {COMMIT_A: tensors_a, COMMIT_B: tensors_b}
    yield server
    server.close()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    """HF_ENDPOINT at the local hub, an empty cache, no token, online."""
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with hub.lock:
        hub.requests.clear()
    return tmp_path / "cache"


def loader(**load: object) -> SafetensorsLoader:
    return SafetensorsLoader.for_load(None, LoadConfig(**load))


def weights(source) -> dict[str, torch.Tensor]:
    return dict(loader().iter_weights(source, "float32"))


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_downloads_only_the_files_the_model_needs(hub, env):
    source = loader().resolve("org/tiny")
    assert sorted(hub.gets("org/tiny")) == sorted(NEEDED)  # each once, nothing else
    assert Path(source.path) == env / "models--org--tiny" / "snapshots" / COMMIT_A
    assert (env / "models--org--tiny" / "refs" / "main").read_text() == COMMIT_A
    assert source.hf_config == CONFIG and source.generation_config["temperature"] == 0.5
    assert_same_tensors(weights(source), hub.tensors[COMMIT_A])


def test_revision_reaches_weights_and_tokenizer(hub, env):
    registry = PluginRegistry()
    for overrides in ({"model": "org/tiny@v1"}, {"model": "org/tiny", "engine": {"revision": "v1"}}):
        config = load_config(None, overrides)
        loader_used, source = resolve_source(registry, config, load_config_for(config))
        assert Path(source.path).name == COMMIT_B
        assert_same_tensors(dict(loader_used.iter_weights(source, "float32")), hub.tensors[COMMIT_B])
        tokenizer = load_tokenizer(registry, config, source)
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "B:hi"
    main = load_config(None, {"model": "org/tiny"})
    assert (
        load_tokenizer(registry, main, resolve_source(registry, main)[1]).apply_chat_template(
            [{"role": "user", "content": "hi"}]
        )
        == "A:hi"
    )
    conflicting = load_config(None, {"model": "org/tiny@v1", "engine": {"revision": "main"}})
    with pytest.raises(ValueError, match=r"pins revision 'v1' but engine.revision = 'main'"):
        resolve_source(registry, conflicting, load_config_for(conflicting))


def test_offline_miss_errors_before_any_network_then_the_cache_serves(hub, env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"'org/tiny' at revision 'v1' is not in the local cache .*HF_HUB_OFFLINE"):
        loader().resolve("org/tiny@v1")
    assert hub.requests == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    downloaded = loader().resolve("org/tiny@v1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with hub.lock:
        hub.requests.clear()
    assert loader().resolve("org/tiny@v1").path == downloaded.path
    assert hub.requests == []


def test_a_commit_resolves_to_its_snapshot_without_a_refs_file(hub, env):
    source = loader().resolve(f"org/tiny@{COMMIT_B}")
    assert Path(source.path) == env / "models--org--tiny" / "snapshots" / COMMIT_B
    assert not (env / "models--org--tiny" / "refs").exists()
    with hub.lock:
        hub.requests.clear()
    # A complete snapshot of a commit is used as it is: a commit never changes.
    assert loader().resolve(f"org/tiny@{COMMIT_B}").path == source.path
    assert hub.requests == []
    assert_same_tensors(weights(source), hub.tensors[COMMIT_B])


def test_cache_folder_download_dir_then_hf_hub_cache_then_hf_home(hub, env, tmp_path, monkeypatch):
    assert Path(loader(download_dir=str(tmp_path / "mine")).resolve("org/tiny").path).is_relative_to(tmp_path / "mine")
    assert Path(loader().resolve("org/tiny").path).is_relative_to(env)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert Path(loader().resolve("org/tiny").path).is_relative_to(tmp_path / "home" / "hub")
    config = load_config(None, {"model": "org/tiny", "engine": {"download_dir": str(tmp_path / "engine")}})
    _, source = resolve_source(PluginRegistry(), config, load_config_for(config))
    assert Path(source.path).is_relative_to(tmp_path / "engine")


def test_a_gated_repo_needs_hf_token_which_every_request_carries(hub, env, monkeypatch):
    with pytest.raises(ValueError, match=r"'org/gated' at revision 'main'.*gated.*HF_TOKEN"):
        loader().resolve("org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with hub.lock:
        hub.requests.clear()
    loader().resolve("org/gated")
    assert hub.requests and all(request.authorization == "Bearer hf_secret" for request in hub.requests)


def test_unknown_repo_and_revision_name_the_fix(hub, env):
    with pytest.raises(ValueError, match=r"'org/missing'.*no such repo, or it is private"):
        loader().resolve("org/missing")
    with pytest.raises(ValueError, match=r"'org/tiny' at revision 'v9'.*no such branch, tag or commit"):
        loader().resolve("org/tiny@v9")


def test_an_unreachable_hub_falls_back_to_the_cached_branch_or_says_so(hub, env, monkeypatch, caplog):
    downloaded = loader().resolve("org/tiny")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    assert loader().resolve("org/tiny").path == downloaded.path
    assert "using the cached snapshot" in caplog.text
    with pytest.raises(ValueError, match=r"'org/tiny' at revision 'v1'.*could not be reached.*HF_ENDPOINT"):
        loader().resolve("org/tiny@v1")


def test_two_concurrent_starts_share_one_download(hub, env, tmp_path):
    hub.slow_files = {"model-00001-of-00002.safetensors"}
    code = textwrap.dedent("""
        from weft.hub import snapshot
        print(snapshot("org/tiny"))
    """)
    processes = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    hub.slow_files = set()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr
    paths = {stdout.strip() for stdout, _ in outputs}
    assert paths == {str(env / "models--org--tiny" / "snapshots" / COMMIT_A)}
    gets = hub.gets("org/tiny")
    assert sorted(gets) == sorted(NEEDED), "each file is downloaded once, by one of the two processes"
    assert_same_tensors(weights(loader().resolve("org/tiny")), hub.tensors[COMMIT_A])


def test_a_local_folder_reads_only_the_shards_its_index_names(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file({"a": torch.ones(2)}, folder / "model-00001-of-00001.safetensors")
    save_file({"a": torch.zeros(2)}, folder / "consolidated.safetensors")  # the same tensor again: must be skipped
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}})
    )
    source = loader().resolve(str(folder))
    assert_same_tensors(weights(source), {"a": torch.ones(2)})
