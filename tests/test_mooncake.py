"""weft-mooncake against a real Mooncake master and storage node, started here on free loopback ports.

The reference for every output is the same model run without a connector.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import msgspec
import pytest

from conftest import make_tiny_model
from weft.engine.core.kv_cache_manager import block_hashes
from weft.entrypoints.llm import LLM
from weft.sampling_params import SamplingParams
from weft.testing import KVConnectorContract
from weft_mooncake.local import LocalMooncake
from weft_mooncake.system import missing_library_problem

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = {"num_kv_blocks": 96, "max_model_len": 200, "block_size": 16}
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHARED = [(7 * i + 3) % 4000 + 10 for i in range(70)]  # 4 full blocks and 6 tokens


@pytest.fixture(scope="module")
def mooncake_runs() -> None:
    """Skips the test when Mooncake's client or binaries cannot load a system library (named in the reason)."""
    problem = missing_library_problem()
    if problem is not None:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def store(mooncake_runs, tmp_path_factory):
    with LocalMooncake(segment_size=128 << 20, log_dir=tmp_path_factory.mktemp("mooncake")) as running:
        yield running


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_files)


def connected(model: Path, store: LocalMooncake, engine: dict | None = None, **options) -> LLM:
    return LLM(
        model=str(model),
        engine={**ENGINE, **(engine or {})},
        use={"kv_connector": "mooncake"},
        plugins={"mooncake": store.options(**options)},
    )


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(model), engine=ENGINE)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]


def count_prefill_tokens(llm: LLM) -> list[int]:
    """Counts the prompt tokens the model runner computes (the engine's own stats are not the witness)."""
    counted = [0]
    runner = llm.engine.runner
    execute = runner.execute

    def counting(step):
        known = {new.request_id: (new.num_computed_tokens, new.num_prompt_tokens) for new in step.new_requests}
        for cached in step.cached_requests:
            known[cached.request_id] = (
                cached.num_computed_tokens,
                runner.requests[cached.request_id].num_prompt_tokens,
            )
        for request_id, count in step.num_scheduled_tokens.items():
            done, prompt = known[request_id]
            counted[0] += max(0, min(count, prompt - done))
        return execute(step)

    runner.execute = counting
    return counted


def stored(store: LocalMooncake, keys: list[str]) -> list[int]:
    """Which keys the store holds, asked by a separate Mooncake client."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", store.metadata_server, 0, 0, "tcp", "", store.master_server_address) == 0
    try:
        return client.batch_is_exist(keys)
    finally:
        client.close()


def keys_for(llm: LLM, group: str, prompt: list[int], run: tuple[int, int] | None = None) -> list[str]:
    """The documented key layout, rebuilt from the engine's model identity and the prompt's block hashes;
    ``run``: (layers_per_object, run) of objects holding a run of layers."""
    context = llm.engine.kv_connector.scheduler_side.context
    prefix = f"weft/{context.model}/float32/tp0of1/pp0of1/{group}/16/"
    if run is not None:
        prefix += f"layers{run[0]}/{run[1]}/"
    return [prefix + block_hash.hex() for block_hash in block_hashes(prompt, 16)]


def block_bytes(llm: LLM) -> int:
    """Bytes of one stored 16-token block: keys and values of every layer (the model's own KV-cache spec)."""
    (group,) = llm.engine.core.scheduler.kv_cache.groups
    return group.spec.page_size_bytes() * len(group.layer_names)


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_a_second_engine_loads_the_shared_prefix_from_the_store(store, llama, load_async):
    shared = [(7 * i + 3 + 50 * load_async) % 4000 + 10 for i in range(70)]  # 4 full blocks and 6 tokens
    first_prompt, second_prompt = shared + [11, 12, 13], shared + [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    expected = reference(llama, [first_prompt, second_prompt])

    with connected(llama, store, load_async=load_async) as first:
        assert generate(first, [first_prompt]) == expected[:1]
        assert first.engine.kv_connector.stats.hit_tokens == 0
    assert stored(store, keys_for(first, "attention", first_prompt)) == [1, 1, 1, 1]

    with connected(llama, store, load_async=load_async) as second:
        computed = count_prefill_tokens(second)
        assert generate(second, [second_prompt]) == expected[1:]
        stats = second.engine.kv_connector.stats
        metrics = second.engine.kv_connector.metric_totals
        assert metrics["loaded_bytes_total"].total == 4 * block_bytes(second)
        assert metrics["load_seconds"].count == 1
    assert (stats.hits, stats.hit_tokens, stats.failed_load_tokens) == (1, 64, 0)
    assert computed[0] == len(second_prompt) - 64
    # The blocks of the second prompt's tail were saved too (5 full blocks of 80 tokens).
    assert stored(store, keys_for(second, "attention", second_prompt)) == [1] * 5


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_objects_of_one_layer_each_land_layer_by_layer(store, llama, load_async):
    """layers_per_object = 1: an object per block and layer (keys name the run); a synchronous load lands the
    first layer of every block, then the second, and the output is the same as without the store."""
    shared = [(11 * i + 5 + 60 * load_async) % 4000 + 10 for i in range(70)]  # 4 full blocks and 6 tokens
    first_prompt, second_prompt = shared + [11, 12, 13], shared + [21, 22, 23, 24]
    expected = reference(llama, [first_prompt, second_prompt])
    with connected(llama, store, layers_per_object=1, load_async=load_async) as first:
        assert generate(first, [first_prompt]) == expected[:1]
    for run in (0, 1):  # the tiny model has 2 layers
        assert stored(store, keys_for(first, "attention", first_prompt, (1, run))) == [1, 1, 1, 1]
    assert stored(store, keys_for(first, "attention", first_prompt)) == [0, 0, 0, 0]

    with connected(llama, store, layers_per_object=1, load_async=load_async) as second:
        worker = second.engine.runner.connector.worker_side
        moved, move = [], worker._move
        worker._move = lambda request_id, objects, queued: (
            moved.extend(stored.part for stored in objects),
            move(request_id, objects, queued),
        )[1]
        assert generate(second, [second_prompt]) == expected[1:]
        metrics = second.engine.kv_connector.metric_totals
        assert metrics["loaded_bytes_total"].total == 4 * block_bytes(second)
        assert second.engine.kv_connector.stats.hit_tokens == 64
    assert moved == [0] * 4 + [1] * 4  # every block's first layer, then every block's second


def test_a_consumer_loads_but_never_saves_and_a_producer_saves_but_never_loads(store, llama):
    prompt = [(5 * i + 1) % 3000 + 20 for i in range(50)]  # three full blocks
    expected = reference(llama, [prompt])
    with connected(llama, store, role="consumer") as consumer:
        assert generate(consumer, [prompt]) == expected
    assert stored(store, keys_for(consumer, "attention", prompt)) == [0, 0, 0]
    for _ in range(2):
        with connected(llama, store, role="producer") as producer:
            assert generate(producer, [prompt]) == expected
            assert producer.engine.kv_connector.stats.hit_tokens == 0
    assert stored(store, keys_for(producer, "attention", prompt)) == [1, 1, 1]
    with connected(llama, store, role="consumer") as consumer:
        assert generate(consumer, [prompt]) == expected
        assert consumer.engine.kv_connector.stats.hit_tokens == 48


def test_the_last_token_is_always_computed_and_short_prompts_match_nothing(store, llama):
    exact = [(3 * i + 2) % 2000 + 30 for i in range(32)]  # exactly two blocks
    expected = reference(llama, [exact, exact[:10]])
    with connected(llama, store) as first:
        generate(first, [exact])
    with connected(llama, store) as second:
        computed = count_prefill_tokens(second)
        assert generate(second, [exact, exact[:10]]) == expected
        # One block loaded; the second holds the last token, so it is computed; a 10-token prompt has no block.
        assert second.engine.kv_connector.stats.hit_tokens == 16
        assert computed[0] == 16 + 10


RING_FAMILY = '''
    from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from weft.layers.attention import Attention
    from weft.models.llama import LlamaFamily, LlamaSettings, layer_name


    class RingAttention(Attention):
        """A ring group is the model's own (no backend metadata for it): build the backend's view of it here."""

        def forward(self, query, key, value, context):
            metadata = context.backend.build_metadata(context.batches[self.group])
            return context.backend.forward(self.spec, query, key, value, context.kv_caches[self.layer_name], metadata)


    class RingWindowFamily(LlamaFamily):
        """Llama whose sliding-window layers keep their KV in a ring group, as DeepSeek V4 does: not prefix-cacheable.

        The ring's one block spans max_model_len tokens (an odd size: it must not change the
        store's block size), so its ring layout is the plain one and the attention backend can
        attend over it; DeepSeek V4's own rings are tested in tests/test_dsv4.py.
        """

        def kv_cache_shape(self, spec, num_blocks):
            if spec.paged_attention:
                return None
            return (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

        def kv_cache_groups(self, config):
            settings = LlamaSettings(config.hf_config, config.architecture)
            windows = settings.sliding_windows
            full = tuple(layer_name(i) for i, window in enumerate(windows) if window is None)
            ring = tuple(layer_name(i) for i, window in enumerate(windows) if window is not None)
            shape = dict(dtype=config.dtype, num_kv_heads=settings.num_kv_heads, head_dim=settings.head_dim)
            return (
                KVCacheGroupSpec("attention", full, FullAttentionSpec(block_size=config.block_size, **shape)),
                KVCacheGroupSpec("window_ring", ring, SlidingWindowSpec(
                    block_size=config.max_model_len, window=max(w for w in windows if w), ring=True, **shape)),
            )

        def build(self, config, device):
            module = super().build(config, device)
            for layer in module.model.layers:
                attn = layer.self_attn.attn
                if attn.spec.sliding_window is not None:
                    layer.self_attn.attn = RingAttention(attn.layer_name, 1, attn.spec)
            return module
'''


@pytest.fixture
def ring_model(tmp_path, tokenizer_files, site, monkeypatch) -> Path:
    folder = make_tiny_model(tmp_path / "ring", "mistral-window", tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["RingWindowForCausalLM"]
    config["layer_types"] = ["full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    site.add_distribution(
        "weft-ring-window",
        entry_points={"weft.model": {"RingWindowForCausalLM": "ring_window:RingWindowFamily"}},
        modules={"ring_window": RING_FAMILY},
    )
    monkeypatch.syspath_prepend(str(site.root))
    return folder


def test_a_model_with_a_ring_group_starts_and_stores_only_the_storable_group(store, ring_model):
    prompt = SHARED + [40, 41]
    expected = reference(ring_model, [prompt, prompt])

    with connected(ring_model, store) as first:
        groups = first.engine.core.scheduler.kv_cache.groups
        assert [group.prefix_cacheable for group in groups] == [True, False]
        assert first.engine.worker.kv_connector.worker_side.block_size == 16
        assert generate(first, [prompt]) == expected[:1]
    assert stored(store, keys_for(first, "attention", prompt)) == [1, 1, 1, 1]
    assert stored(store, keys_for(first, "window_ring", prompt)) == [0, 0, 0, 0]

    with connected(ring_model, store) as second:  # the ring's state cannot be loaded: the prompt is computed in full
        computed = count_prefill_tokens(second)
        assert generate(second, [prompt]) == expected[1:]
        assert second.engine.kv_connector.stats.hit_tokens == 0
    assert computed[0] == len(prompt)


def test_a_killed_master_leaves_requests_complete_and_a_restarted_one_is_used_again(
    mooncake_runs, tmp_path, llama, caplog
):
    prompts = [[(11 * i + 5 * p) % 5000 + 40 for i in range(40 + 6 * p)] for p in range(6)]
    expected = reference(llama, prompts)
    with LocalMooncake(segment_size=64 << 20, log_dir=tmp_path) as store:
        llm = connected(llama, store, engine={"max_num_batched_tokens": 24})  # prefills span several steps
        engine = llm.engine
        assert generate(llm, prompts[:1]) == expected[:1]

        steps = [0]
        execute = engine.runner.execute

        def kill_on_third_step(step):
            steps[0] += 1
            if steps[0] == 3:
                store.kill_master()
            return execute(step)

        engine.runner.execute = kill_on_third_step
        with caplog.at_level(logging.WARNING, logger="weft.mooncake"):
            assert generate(llm, prompts[1:4]) == expected[1:4]  # in flight when the master dies
            assert generate(llm, prompts[4:5]) == expected[4:5]  # admitted while it is away
        warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
        assert any("unreachable (save failed" in message for message in warnings), warnings
        assert any("unreachable (lookup failed" in message for message in warnings), warnings
        assert engine.worker.kv_connector.worker_side.dropped_saves > 0, "saves were planned while the master was away"
        engine.runner.execute = execute
        assert engine.core.wait_for_saves(timeout=30)
        assert engine.kv_cache_manager.usage() == 0, "every block is back once the requests finished"

        store.start_master()
        store.wait_for_segment()
        connector = engine.kv_connector
        deadline = time.monotonic() + 60
        worker_side = engine.worker.kv_connector.worker_side
        while not (connector.scheduler_side.client.available and worker_side.client.available):
            assert time.monotonic() < deadline, "the connector did not reconnect to the restarted master"
            time.sleep(0.2)
        assert generate(llm, prompts[5:6]) == expected[5:6]
        llm.close()
        assert stored(store, keys_for(llm, "attention", prompts[5])) == [1] * (len(prompts[5]) // 16)

        with connected(llama, store) as second:
            assert generate(second, prompts[5:6]) == expected[5:6]
            assert second.engine.kv_connector.stats.hit_tokens == (len(prompts[5]) - 1) // 16 * 16


@pytest.mark.parametrize("layers_per_object", [0, 1], ids=["whole", "layerwise"])
@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_a_load_that_fails_mid_way_is_recomputed(store, llama, caplog, load_async, layers_per_object):
    """The store claims the blocks (the keys exist) but holds an object of the wrong size in the middle: the
    blocks before it are written, then the load fails (layer by layer: the second layer of the second block,
    after the first layer of every block landed and the forward may have started)."""
    from mooncake.store import MooncakeDistributedStore

    salt = 40 * load_async + 20 * layers_per_object
    prompt = [(13 * i + 7 + salt) % 4500 + 50 for i in range(60)]  # three full blocks to load, 12 after
    expected = reference(llama, [prompt])
    with connected(llama, store, layers_per_object=layers_per_object) as first:
        generate(first, [prompt])
    run = (1, 1) if layers_per_object else None
    middle = keys_for(first, "attention", prompt, run)[1]
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", store.metadata_server, 0, 1 << 20, "tcp", "", store.master_server_address) == 0
    try:
        assert client.remove(middle, True) == 0
        assert client.put(middle, b"\1" * 64) == 0
    finally:
        client.close()

    with (
        connected(llama, store, load_async=load_async, layers_per_object=layers_per_object) as second,
        caplog.at_level(logging.WARNING, logger="weft.engine"),
    ):
        computed = count_prefill_tokens(second)
        assert generate(second, [prompt]) == expected
        stats = second.engine.kv_connector.stats
    assert (stats.hit_tokens, stats.failed_load_tokens) == (48, 48)
    messages = [record.getMessage() for record in caplog.records]
    if load_async:  # it waited outside the batch: no step relied on the load
        assert computed[0] == len(prompt)
        assert any("could not receive 48 tokens" in message for message in messages), messages
    else:  # the step that relied on the load, then all of it again
        assert computed[0] == (len(prompt) - 48) + len(prompt)
        assert any("could not load 48 tokens" in message for message in messages), messages


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_a_loader_that_raises_is_a_failed_load_not_a_stall(store, llama, load_async):
    """An exception escaping the loader thread itself (a bug, not a store error) fails the load: the request is
    recomputed with unchanged output, nothing waits for it forever."""
    prompt = [(17 * i + 3 + 50 * load_async) % 4200 + 60 for i in range(52)]  # three full blocks to load
    expected = reference(llama, [prompt])
    with connected(llama, store) as first:
        generate(first, [prompt])
    with connected(llama, store, load_async=load_async) as second:
        worker = second.engine.runner.connector.worker_side

        def broken(request_id, objects, queued):
            raise RuntimeError("a bug in the loader")

        worker._move = broken
        assert generate(second, [prompt]) == expected
        assert second.engine.kv_connector.stats.failed_load_tokens == 48


def test_a_request_loading_from_the_store_waits_outside_the_batch_while_another_steps(store, llama):
    shared = [(31 * i + 11) % 6000 + 70 for i in range(96)]  # six full blocks
    loading, other = shared + [1, 2, 3], [(3 * i + 1) % 900 + 5 for i in range(20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(llama), engine=ENGINE)
    expected = [output.outputs[0].token_ids for output in plain.generate([other, loading], params)]
    with connected(llama, store) as first:
        generate(first, [shared + [9]])

    with connected(llama, store) as second:
        scheduler, runner = second.engine.scheduler, second.engine.runner
        computed = count_prefill_tokens(second)
        execute, steps = runner.execute, []

        def watching(step):
            prompts = {
                request_id: tuple(request.prompt_token_ids) for request_id, request in scheduler.requests.items()
            }
            steps.append(
                (
                    {prompts[request_id] for request_id in step.num_scheduled_tokens},
                    {tuple(request.prompt_token_ids) for request in scheduler.receiving.values()},
                )
            )
            return execute(step)

        runner.execute = watching
        outputs = second.generate([other, loading], params)
        stats = second.engine.kv_connector.stats
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert (stats.hits, stats.hit_tokens, stats.failed_load_tokens) == (1, 96, 0)
    assert computed[0] == len(other) + len(loading) - 96
    while_loading = [stepped for stepped, receiving in steps if tuple(loading) in receiving]
    assert while_loading and all(tuple(loading) not in stepped for stepped in while_loading)
    assert any(tuple(other) in stepped for stepped in while_loading), "the other request stepped while one loaded"


def test_loads_are_synchronous_under_tensor_or_pipeline_parallelism(store, caplog):
    """A lookup of blocks the store holds for each layout: offered asynchronously on one rank only."""
    import uuid

    import msgspec
    from mooncake.store import MooncakeDistributedStore

    from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
    from weft.contracts.kv_connector import ConnectorContext, ConnectorRequest
    from weft_mooncake.connector import MooncakeOptions, MooncakeStoreConnector

    groups = (
        KVCacheGroupSpec(
            "attention", ("layer.0",), FullAttentionSpec(block_size=16, dtype="float32", num_kv_heads=2, head_dim=8)
        ),
    )
    prompt = list(range(40, 90))  # three full blocks
    request = ConnectorRequest("r", tuple(prompt), tuple(block_hashes(prompt, 16)))
    options = msgspec.convert(store.options(), MooncakeOptions)
    model = f"layouts-{uuid.uuid4().hex}"
    writer = MooncakeDistributedStore()
    assert writer.setup("127.0.0.1", store.metadata_server, 0, 1 << 20, "tcp", "", store.master_server_address) == 0
    answers = {}
    try:
        for tp_size, pp_size in ((1, 1), (2, 1), (1, 2)):
            context = ConnectorContext(model=model, tp_size=tp_size, pp_size=pp_size)
            with caplog.at_level(logging.INFO, logger="weft.mooncake"):
                scheduler = MooncakeStoreConnector(options, "scheduler", groups, context)
            try:
                keys = [scheduler.key(0, block_hash) for block_hash in request.block_hashes]
                assert [writer.put(key, b"\0" * 64) for key in keys] == [0, 0, 0]
                answers[tp_size, pp_size] = scheduler.get_num_new_matched_tokens(request, 0)
            finally:
                scheduler.close()
    finally:
        writer.close()
    assert answers == {(1, 1): (48, True), (2, 1): (48, False), (1, 2): (48, False)}
    assert (
        sum(
            "loads synchronously under tensor or pipeline parallelism" in record.getMessage()
            for record in caplog.records
        )
        == 2
    )


def test_a_request_that_ends_while_loading_keeps_its_blocks_until_the_load_is_over(store, llama):
    prompt = [(37 * i + 5) % 7000 + 90 for i in range(84)]  # five full blocks
    with connected(llama, store) as first:
        generate(first, [prompt])
    with connected(llama, store) as second:
        engine = second.engine
        execute, aborted = engine.runner.execute, []

        def abort_once_its_load_started(step):
            handle = execute(step)  # the worker starts the loads the step's metadata names
            if "ends" in engine.scheduler.receiving:  # before the step's report: the load may be in flight
                engine.abort("ends")
                aborted.append(True)
            return handle

        engine.runner.execute = abort_once_its_load_started
        engine.add_request("ends", prompt, GREEDY)
        engine.step()
        assert aborted, "the request was admitted to load outside the batch"
        assert engine.kv_connector.stats.delayed_frees == 1, "its blocks stay while a load may write into them"
        assert engine.core.wait_for_saves(timeout=30)
        assert engine.kv_cache_manager.usage() == 0


def test_a_device_cache_stages_the_bytes_a_host_cache_stores():
    """The device path's gather and scatter (run here on host tensors) against the buffer slices through which
    the host path hands the store the cache's own bytes."""
    import ctypes

    import torch

    from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec
    from weft_mooncake.blocks import HostBlocks, byte_layers, gather_blocks, group_layers, scatter_blocks
    from weft_mooncake.connector import BlockTransfer

    group = KVCacheGroupSpec(
        "attention", ("l0", "l1", "l2"), FullAttentionSpec(block_size=4, dtype="float32", num_kv_heads=2, head_dim=8)
    )
    caches = {name: torch.randn(2, 10, 4, 2, 8) for name in group.layer_names}
    objects = [BlockTransfer(b"a", 0, (7, 2)), BlockTransfer(b"b", 0, (3, 9))]
    layers = group_layers(group, caches)
    (batch,) = HostBlocks({0: layers}, lambda address, size: None).batches(objects, "save")
    stored = b"".join(
        ctypes.string_at(address, size)
        for addresses, sizes in zip(batch.addresses, batch.sizes, strict=False)
        for address, size in zip(addresses, sizes, strict=False)
    )

    blocks = torch.tensor([7, 2, 3, 9])
    staged = torch.empty(2, 3, 2, 2, layers.block_bytes, dtype=torch.uint8)
    gather_blocks(byte_layers(layers.tensors, layers.block_bytes), blocks, staged)
    assert staged.numpy().tobytes() == stored

    loaded = {name: torch.zeros_like(cache) for name, cache in caches.items()}
    scatter_blocks(staged, blocks, byte_layers(group_layers(group, loaded).tensors, layers.block_bytes))
    for name, cache in caches.items():
        assert torch.equal(loaded[name][:, blocks], cache[:, blocks])
        assert not loaded[name][:, [0, 1, 4, 5, 6, 8]].any(), "no other block is written"


class TestMooncakeConnectorContract(KVConnectorContract):
    plugin_name = "mooncake"

    @pytest.fixture
    def connector_options(self, store):
        return store.options()

    @pytest.fixture
    def model_source(self, llama):
        return str(llama)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"plugins.mooncake.master_server_address": "nohost"},
            "plugins.mooncake.master_server_address: expected str matching",
        ),
        (
            {"plugins.mooncake.role": "reader"},
            "plugins.mooncake.role: expected one of 'both', 'producer', 'consumer', got 'reader'",
        ),
        ({"plugins.mooncake.global_segment_size": -1}, "plugins.mooncake.global_segment_size: expected int >= 0"),
        (
            {"plugins.mooncake.master": "h:1"},
            "plugins.mooncake.master: unknown key. Valid keys here: master_server_address",
        ),
        ({"plugins.mooncake.protocol": "rdma"}, "protocol = 'rdma' needs device_name"),
        ({"plugins.mooncake.load_async": "yes"}, "plugins.mooncake.load_async: expected bool, got str"),
        (
            {"plugins.mooncake.staging_buffer_size": 4096},
            "plugins.mooncake.staging_buffer_size: expected int >= 1048576",
        ),
    ],
)
def test_options_are_checked_with_errors_naming_the_key(overrides, message):
    from weft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, overrides)


def test_an_unreachable_master_is_a_clear_start_up_error(mooncake_runs, llama):
    from weft_mooncake.local import free_port

    port = free_port()
    with pytest.raises(ConnectionError, match=f"master_server_address = '127.0.0.1:{port}'"):
        LLM(
            model=str(llama),
            engine=ENGINE,
            use={"kv_connector": "mooncake"},
            plugins={
                "mooncake": {
                    "master_server_address": f"127.0.0.1:{port}",
                    "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
                }
            },
        )


def test_preempted_requests_give_the_same_tokens_and_are_stored(store, llama):
    prompts = [[(17 * i + 29 * p) % 6000 + 60 for i in range(90 + 5 * p)] for p in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(llama), engine=ENGINE)
    expected = [output.outputs[0].token_ids for output in plain.generate(prompts, params)]
    with connected(llama, store, engine={"num_kv_blocks": 16}) as tight:  # room for two of the requests at a time
        preemptions = []
        preempt = tight.engine.scheduler._preempt
        tight.engine.scheduler._preempt = lambda request: (preemptions.append(request.request_id), preempt(request))
        assert [output.outputs[0].token_ids for output in tight.generate(prompts, params)] == expected
    assert preemptions, "the test needs preemptions"
    for prompt in prompts:
        assert stored(store, keys_for(tight, "attention", prompt)) == [1] * (len(prompt) // 16)


def test_two_servers_share_the_store_and_report_hits_in_metrics(store, llama, start_server):
    """Two real HTTP servers, one after the other: the second serves the shared prefix from the store."""
    import httpx

    shared = [(19 * i + 3) % 5000 + 70 for i in range(64)]
    prompts = [shared + [5, 6, 7], shared + [8, 9, 10, 11]]
    expected = reference(llama, prompts)
    config = {
        "model": str(llama),
        "engine": ENGINE,
        "use": {"kv_connector": "mooncake"},
        "plugins": {"mooncake": store.options()},
    }
    answers = []
    for prompt in prompts:
        server = start_server(**config)
        body = {
            "model": server.engine.model_name,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["text"])
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        hits = server.engine.stats.connector_hit_tokens
        server.stop()  # the server's shutdown closes the engine, which waits for its saves
    assert f"weft_external_prefix_cache_hits_total {float(hits)}" in metrics and hits == 64
    tokenizer = LLM(model=str(llama), engine=ENGINE).tokenizer
    assert answers == [tokenizer.decode(tokens) for tokens in expected]


def test_what_an_engine_process_saved_outlives_it(store, llama):
    """The first engine runs in its own process, which exits before the second engine starts."""
    import subprocess
    import sys
    import textwrap

    prompt = [(23 * i + 9) % 7000 + 80 for i in range(52)]  # three full blocks
    expected = reference(llama, [prompt])
    code = textwrap.dedent(f"""
        from weft import LLM, SamplingParams
        with LLM(model={str(llama)!r}, engine={ENGINE!r}, use={{"kv_connector": "mooncake"}},
                 plugins={{"mooncake": {store.options()!r}}}) as llm:
            llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens=1))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with connected(llama, store) as later:
        assert generate(later, [prompt]) == expected
        assert later.engine.kv_connector.stats.hit_tokens == 48


def test_objects_in_an_engines_own_segment_vanish_with_it(mooncake_runs, tmp_path, llama):
    """No storage node: the engine contributes the memory (global_segment_size > 0), so its objects die with it."""
    store = LocalMooncake(log_dir=tmp_path)
    store.start_master()
    try:
        prompt = [(29 * i + 1) % 8000 + 90 for i in range(50)]  # three full blocks
        expected = reference(llama, [prompt])
        with connected(llama, store, global_segment_size=64 << 20) as contributing:
            assert generate(contributing, [prompt]) == expected
            assert contributing.engine.core.wait_for_saves(timeout=30)  # its saves are done
            with connected(llama, store) as reader:
                assert generate(reader, [prompt]) == expected
                assert reader.engine.kv_connector.stats.hit_tokens == 48
        with connected(llama, store) as later:
            assert generate(later, [prompt]) == expected
            assert later.engine.kv_connector.stats.hit_tokens == 0
    finally:
        store.stop()


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_deepseek_v4_resumes_a_prefix_loaded_from_the_store_from_its_loaded_snapshots(store, tmp_path, load_async):
    """DeepSeek V4 under prefix caching stores its snapshot groups with the entries; a second engine
    loads them and restores the ring and compressor state from them, giving the tokens of no hit."""
    pytest.importorskip("weft_dsv4")
    from weft_dsv4.tiny_checkpoint import SHORT_NAMES, tiny_config, write_checkpoint

    model = write_checkpoint(
        tmp_path, tiny_config([SHORT_NAMES[kind] for kind in ("hca", "csa", "sliding", "csa")], index_topk=3), seed=11
    )
    engine = {"block_size": 8, "num_kv_blocks": 64, "max_model_len": 128, "enable_prefix_caching": True}
    shared = [(5 * i + 1 + 30 * load_async) % 500 + 2 for i in range(52)]
    first_prompt, second_prompt = shared + [11, 12], shared + [21, 22, 23, 24, 25, 26, 27]
    plain = LLM(model=str(model), engine={**engine, "enable_prefix_caching": False})
    expected = [output.outputs[0].token_ids for output in plain.generate([first_prompt, second_prompt], GREEDY)]

    with connected(model, store, engine, load_async=load_async) as first:
        assert generate(first, [first_prompt]) == expected[:1]
    with connected(model, store, engine, load_async=load_async) as second:
        unit = second.engine.kv_connector.block_size
        computed = count_prefill_tokens(second)
        assert generate(second, [second_prompt]) == expected[1:]
        hit = second.engine.kv_connector.stats.hit_tokens
    assert {"window_checkpoint", "state_checkpoint"} <= {
        group.name for group in second.engine.core.scheduler.kv_cache.groups
    }
    assert hit == (len(shared) // unit) * unit > 0 and computed[0] == len(second_prompt) - hit


def test_layers_per_object_is_refused_under_pipeline_parallelism(store):
    """Each stage holds only its own layers, so its runs of layers and the engine's would differ."""
    from weft.contracts.kv_connector import ConnectorContext
    from weft_mooncake.connector import MooncakeOptions, MooncakeStoreConnector

    options = msgspec.convert(store.options(layers_per_object=2), MooncakeOptions)
    context = ConnectorContext(model="m", tp_rank=0, tp_size=1, pp_rank=0, pp_size=2)
    with pytest.raises(ValueError, match=r"layers_per_object = 2 .*\(pipeline_parallel_size = 2\)"):
        MooncakeStoreConnector(options, "scheduler", (), context)


def test_the_encoder_connector_keeps_outputs_by_model_and_item_hash_and_keeps_to_its_role(store):
    """E/P/D's hand-over through the store (``use.encoder_connector = "mooncake"``): what one connector saves under an
    item hash another loads, for the same model only; a save replaces the value; a consumer never saves, a producer
    never loads. (``tests/test_epd.py`` runs it end to end.)"""
    from weft.contracts.encoder_connector import EncoderConnectorContext
    from weft_mooncake.connector import MooncakeOptions
    from weft_mooncake.encoder import MooncakeEncoderConnector

    options = msgspec.convert(store.options(), MooncakeOptions)

    def connector(model: str, role: str = "both") -> MooncakeEncoderConnector:
        context = EncoderConnectorContext(model=model)
        return MooncakeEncoderConnector(msgspec.structs.replace(options, role=role), context)

    connectors = [connector("llava@1"), connector("other@2"), connector("llava@1", "consumer")]
    connectors.append(connector("llava@1", "producer"))
    both, other_model, consumer, producer = connectors
    try:
        assert both.load("item-a") is None
        both.save("item-a", b"first output" * 100)
        assert consumer.load("item-a") == b"first output" * 100
        assert other_model.load("item-a") is None
        both.save("item-a", b"second output" * 100)
        assert consumer.load("item-a") == b"second output" * 100
        consumer.save("item-b", b"never saved" * 100)
        assert both.load("item-b") is None
        producer.save("item-c", b"saved" * 100)
        assert producer.load("item-c") is None
        assert both.load("item-c") == b"saved" * 100
        assert stored(store, ["weft/encoder/llava@1/item-a", "weft/encoder/other@2/item-a"]) == [1, 0]
    finally:
        for each in connectors:
            each.close()
