"""Core's built-in attention backend and loaders pass the conformance kit."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from weft.testing import AttentionContract, LoaderContract, ModelContract


class TestTorchAttention(AttentionContract):
    plugin_name = "torch"


class TestSafetensorsLoader(LoaderContract):
    plugin_name = "safetensors"

    @pytest.fixture
    def model_source(self, tmp_path, tokenizer_files):
        return str(make_tiny_model(tmp_path / "tiny", "qwen3", tokenizer_files))


class TestGGUFLoader(LoaderContract):
    plugin_name = "gguf"

    @pytest.fixture
    def model_source(self):
        return "smollm2-135m-instruct"


class TestTorchAttentionSmallBlocks(AttentionContract):
    plugin_name = "torch"
    block_size = 4


class TestLlamaFamilyOnQwen3(ModelContract):
    plugin_name = "Qwen3ForCausalLM"

    @pytest.fixture
    def model_source(self, tmp_path, tokenizer_files):
        return str(make_tiny_model(tmp_path / "tiny", "qwen3", tokenizer_files))


class TestLlamaFamilyOnMistral(ModelContract):
    plugin_name = "MistralForCausalLM"
    block_size = 8

    @pytest.fixture
    def model_source(self, tmp_path, tokenizer_files):
        return str(make_tiny_model(tmp_path / "tiny", "mistral-window", tokenizer_files))
