"""The docs' disk connector (tests/disk_connector, docs/plugin-authors.md) passes the conformance kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_tiny_model
from weft.testing import KVConnectorContract

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files)


class TestDiskConnectorContract(KVConnectorContract):
    plugin_name = "disk"

    @pytest.fixture
    def connector_options(self, tmp_path):
        return {"path": str(tmp_path / "blocks")}

    @pytest.fixture
    def model_source(self, llama):
        return str(llama)


def test_the_docs_demo_run_twice_loads_the_first_runs_blocks_in_the_second(llama, tmp_path, monkeypatch, capsys):
    """docs/plugin-authors.md's two runs, on a small checkpoint: the first in its own process, the second in this
    one."""
    import re
    import runpy
    import subprocess
    import sys

    demo = str(Path(__file__).parent / "disk_connector" / "demo.py")
    arguments = [str(llama), str(tmp_path / "blocks")]
    first = subprocess.run([sys.executable, demo, *arguments], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    monkeypatch.setattr(sys, "argv", [demo, *arguments])
    runpy.run_path(demo, run_name="__main__")
    pattern = r"(\d+) of (\d+) prompt tokens loaded; answer: (.*)"
    first_loaded, length, first_answer = re.fullmatch(pattern, first.stdout.strip()).groups()
    second_loaded, second_length, second_answer = re.fullmatch(pattern, capsys.readouterr().out.strip()).groups()
    assert (first_loaded, second_length, second_answer) == ("0", length, first_answer)
    assert int(second_loaded) == (int(length) - 1) // 16 * 16  # every full block but the one holding the last token


def test_damaged_files_are_failed_loads_and_recomputed(llama, tmp_path, caplog):
    """Its own failure path (the kit's failed-load case poisons loads from outside the connector)."""
    import logging

    from weft import LLM, SamplingParams

    engine = {"block_size": 16, "num_kv_blocks": 64, "max_model_len": 256}
    connected = dict(
        model=str(llama), engine=engine, use={"kv_connector": "disk"}, plugins={"disk": {"path": str(tmp_path)}}
    )
    prompt = [(7 * i + 5) % 900 + 20 for i in range(40)]  # two full blocks
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model=str(llama), engine=engine) as plain:
        expected = plain.generate([prompt], greedy)[0].outputs[0].token_ids
    with LLM(**connected) as first:
        first.generate([prompt], greedy)
    files = list(tmp_path.rglob("*.pt"))
    assert len(files) == 2
    for file in files:
        file.write_bytes(b"not a tensor")
    with LLM(**connected) as second, caplog.at_level(logging.WARNING):
        output = second.generate([prompt], greedy)[0]
    assert output.outputs[0].token_ids == expected and output.num_cached_tokens == 0
    messages = [record.getMessage() for record in caplog.records]
    assert any("weft-example-disk: loading request" in message for message in messages), messages
    assert any("could not load 32 tokens" in message for message in messages), messages


def _groups():
    from weft.contracts.kv_cache import CompressedSpec, FullAttentionSpec, KVCacheGroupSpec

    return (
        KVCacheGroupSpec(
            "attention",
            ("layer.0", "layer.1"),
            FullAttentionSpec(block_size=16, dtype="float32", num_kv_heads=2, head_dim=8),
        ),
        KVCacheGroupSpec(
            "compressed", ("layer.2",), CompressedSpec(block_size=16, dtype="float32", compress_ratio=4, entry_dim=8)
        ),
    )


def test_blocks_of_a_backend_layout_and_a_block_first_layout_come_back_as_saved(tmp_path):
    """Without an engine: a model-managed compressed group (DeepSeek V4's layout) beside plain attention."""
    import torch

    from weft.contracts.kv_connector import ConnectorContext, ConnectorRequest, ConnectorStep, ConnectorStepRequest
    from weft.engine.core.kv_cache_manager import block_hashes
    from weft_example_disk.connector import DiskConnector, DiskOptions

    groups, options = _groups(), DiskOptions(path=str(tmp_path))
    context = ConnectorContext(model="layouts@0")
    shapes = {"layer.0": (2, 9, 16, 2, 8), "layer.1": (2, 9, 16, 2, 8), "layer.2": (9, 4, 8)}
    prompt = list(range(3, 3 + 2 * 16 + 5))  # two full blocks
    request = ConnectorRequest("r", tuple(prompt), tuple(block_hashes(prompt, 16)))
    saved_blocks, loaded_blocks = ((4, 7, 1), (4, 7, 1)), ((0, 5, 8), (2, 3, 6))

    def run_step(caches, block_ids, computed, new, external):
        scheduler, worker = (
            DiskConnector(options, "scheduler", groups, context),
            DiskConnector(options, "worker", groups, context),
        )
        worker.register_kv_caches(caches)
        offered = scheduler.get_num_new_matched_tokens(request, 0)
        scheduler.update_state_after_alloc(request, block_ids, external)
        step = ConnectorStep(requests=(ConnectorStepRequest("r", computed, new, block_ids, external),))
        worker.bind_connector_metadata(scheduler.build_connector_meta(step))
        worker.start_load_kv()
        worker.wait_for_save()
        assert not worker.get_finished(set()).failed_loads
        return offered

    generator = torch.Generator().manual_seed(0)
    written = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    assert run_step(written, saved_blocks, 0, len(prompt), 0) == (0, False)
    restored = {name: torch.zeros(shape) for name, shape in shapes.items()}
    assert run_step(restored, loaded_blocks, 32, len(prompt) - 32, 32) == (32, False)
    for old, new in zip(saved_blocks[0][:2], loaded_blocks[0][:2], strict=False):
        for layer in ("layer.0", "layer.1"):
            assert torch.equal(restored[layer][:, new], written[layer][:, old])
    for old, new in zip(saved_blocks[1][:2], loaded_blocks[1][:2], strict=False):
        assert torch.equal(restored["layer.2"][new], written["layer.2"][old])
    assert not restored["layer.0"][:, loaded_blocks[0][2]].any(), "the third block holds the last token: not loaded"


def test_a_cache_layout_it_does_not_know_is_refused_naming_the_layer(tmp_path):
    import torch

    from weft.contracts.kv_connector import ConnectorContext
    from weft_example_disk.connector import DiskConnector, DiskOptions

    worker = DiskConnector(DiskOptions(path=str(tmp_path)), "worker", _groups(), ConnectorContext(model="layouts@0"))
    blocks_first = {
        "layer.0": torch.zeros(9, 2, 16, 2, 8),
        "layer.1": torch.zeros(2, 9, 16, 2, 8),
        "layer.2": torch.zeros(9, 4, 8),
    }
    with pytest.raises(
        ValueError,
        match=r"KV cache of layer\.0 \(group 'attention', FullAttentionSpec\) has shape "
        r"\(9, 2, 16, 2, 8\).*expected the default \[2, num_blocks, 16",
    ):
        worker.register_kv_caches(blocks_first)
