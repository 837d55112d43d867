"""A closed engine gives its memory back at once: the model's weights and the KV cache are freed by ``close()``
(and by a start that failed after the model loaded), not when the garbage collector next runs. The automatic
collector is off while each check runs: the runner and its last step hold each other, so without the release
in ``Worker.shutdown`` the weights stayed alive here until a collection (on an H200, 138 GiB of them)."""

from __future__ import annotations

import gc
import weakref

import pytest

from conftest import make_tiny_model
from weft import LLM, SamplingParams
from weft.runner.worker import Worker


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("close") / "llama", "llama", tokenizer_files)


@pytest.fixture
def collector_off():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _held(references: list[weakref.ref]) -> int:
    """Bytes still held by the tensors ``references`` name (a tensor kept alive with an emptied storage holds none)."""
    return sum(tensor.untyped_storage().nbytes() for reference in references if (tensor := reference()) is not None)


@pytest.fixture
def tracked(monkeypatch):
    """Weak references to every weight and KV-cache tensor of the workers built while the test runs."""
    references: list[weakref.ref] = []
    load_model, initialize_kv_cache = Worker.load_model, Worker.initialize_kv_cache

    def loading(self, *args, **kwargs):
        try:
            return load_model(self, *args, **kwargs)
        finally:
            if getattr(self, "model", None) is not None:
                references.extend(weakref.ref(tensor) for tensor in (*self.model.parameters(), *self.model.buffers()))

    def allocating(self, *args, **kwargs):
        result = initialize_kv_cache(self, *args, **kwargs)
        references.extend(weakref.ref(tensor) for tensor in self.kv_caches.values())
        return result

    monkeypatch.setattr(Worker, "load_model", loading)
    monkeypatch.setattr(Worker, "initialize_kv_cache", allocating)
    return references


def test_close_frees_the_weights_and_the_kv_cache(tiny_llama, tracked, collector_off):
    llm = LLM(model=str(tiny_llama), num_kv_blocks=64)
    llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(tracked) > 10 and _held(tracked) > 0
    llm.close()
    assert _held(tracked) == 0
    assert all(reference() is None for reference in tracked), "a tensor outlived close() (a reference cycle)"


def test_a_start_that_fails_after_loading_frees_the_weights(tiny_llama, tracked, collector_off):
    with pytest.raises(ValueError, match="the KV cache holds 2 blocks"):  # refused once the model is loaded
        LLM(model=str(tiny_llama), num_kv_blocks=2)
    assert len(tracked) > 10
    assert _held(tracked) == 0
