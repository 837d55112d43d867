"""weft-mooncake with the KV cache on a GPU: two engine processes in turn share a prefix through a real Mooncake
master and storage node (started here on loopback ports), CUDA graphs on.

The first process computes prompts that share a prefix and saves their full blocks; the second
process loads the prefix into its GPU cache (asynchronously, or synchronously layer by layer, through
the pinned staging buffer) and computes only the tails. The reference is a third process without the connector that runs
the same requests in the same order, so its engine's own prefix cache gives the later prompts the prefix
the same way: its greedy tokens are what the second process must produce.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

ENGINE = {"num_kv_blocks": 256, "max_model_len": 512, "block_size": 16, "dtype": "float32"}
SHARED = [(7 * i + 3) % 4000 + 10 for i in range(320)]  # 20 full blocks
FIRST = [SHARED + [11, 12, 13]]
LATER = [SHARED + [(5 * i + 2 * p) % 900 + 20 for i in range(9 + 7 * p)] for p in range(4)]

ENGINE_PROCESS = """
import json, sys
from weft import LLM, SamplingParams
settings, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
with LLM(**settings) as llm:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    worker = llm.engine.worker
    report = {"tokens": tokens, "graphs": sorted(worker.runner.graphs),
              "cache_devices": sorted({str(cache.device) for cache in worker.kv_caches.values()})}
    connector = llm.engine.kv_connector
    if connector is not None:
        stats = connector.stats
        report.update(hit_tokens=stats.hit_tokens, failed_load_tokens=stats.failed_load_tokens,
                      loaded_bytes=connector.metric_totals["loaded_bytes_total"].total
                      if "loaded_bytes_total" in connector.metric_totals else 0,
                      staged=type(worker.kv_connector.worker_side.blocks).__name__)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from weft_mooncake.local import LocalMooncake
    from weft_mooncake.system import missing_library_problem

    problem = missing_library_problem()
    if problem is not None:
        pytest.skip(problem)
    with LocalMooncake(segment_size=512 << 20, log_dir=tmp_path_factory.mktemp("mooncake")) as running:
        yield running


def engine_process(model: Path, prompts: list[list[int]], connector: dict | None) -> dict:
    settings = {"model": str(model), "engine": ENGINE, "use": {"platform": "cuda"}}
    if connector is not None:
        settings["use"]["kv_connector"] = "mooncake"
        settings["plugins"] = {"mooncake": connector}
    result = subprocess.run(
        [sys.executable, "-c", ENGINE_PROCESS, json.dumps(settings), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


@pytest.mark.parametrize(("load_async", "layers_per_object"), [(True, 0), (False, 1)], ids=["async", "sync-layerwise"])
def test_a_second_engine_process_loads_the_prefix_into_its_gpu_cache_with_graphs_on(
    store, tmp_path, tokenizer_files, load_async, layers_per_object
):
    """Asynchronously (the request waits outside the batch), and synchronously with one layer per object (the
    forward waits for each layer's objects just before that layer, while later layers are still arriving)."""
    model = make_tiny_model(tmp_path / "llama", "llama", tokenizer_files)
    reference = engine_process(model, FIRST + LATER, None)
    options = store.options(load_async=load_async, layers_per_object=layers_per_object)

    first = engine_process(model, FIRST, options)
    assert first["tokens"] == reference["tokens"][:1]
    assert first["staged"] == "DeviceBlocks" and first["hit_tokens"] == 0

    second = engine_process(model, LATER, options)
    assert second["cache_devices"] == ["cuda:0"] and second["graphs"], "the KV cache is on the GPU, graphs captured"
    # The first later prompt loads the 20 shared blocks from the store; the others find them in the engine's own
    # prefix cache, as in the reference.
    assert (second["hit_tokens"], second["failed_load_tokens"]) == (320, 0)
    assert second["loaded_bytes"] == 20 * block_bytes(model)
    assert second["tokens"] == reference["tokens"][1:]


def block_bytes(model: Path) -> int:
    """Bytes of one 16-token block of every layer, keys and values, in float32, from the checkpoint's config."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * 16 * config["num_key_value_heads"] * head_dim * 4
