"""The engine's side of the KV-connector contract, with a throwaway connector that answers "not yet"."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model
from weft import LLM, SamplingParams

HESITANT = '''
    from weft.contracts.kv_connector import KVConnector

    ASKED = {}


    class HesitantConnector(KVConnector):
        """Answers "ask again later" twice per request, then "nothing to load"."""

        name = "hesitant"

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ASKED[request.request_id] = ASKED.get(request.request_id, 0) + 1
            return (None, False) if ASKED[request.request_id] <= 2 else (0, False)
'''


@pytest.fixture
def tiny(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", tokenizer_files)


def test_a_request_the_connector_cannot_answer_for_yet_is_passed_over_and_asked_again(tiny, site, monkeypatch):
    site.add_distribution(
        "weft-hesitant",
        entry_points={"weft.kv_connector": {"hesitant": "hesitant:HesitantConnector"}},
        modules={"hesitant": HESITANT},
    )
    monkeypatch.syspath_prepend(str(site.root))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11] * 7]
    engine = {"num_kv_blocks": 64, "max_model_len": 128}
    expected = [output.outputs[0].token_ids for output in LLM(model=str(tiny), engine=engine).generate(prompts, params)]
    with LLM(model=str(tiny), engine=engine, use={"kv_connector": "hesitant"}) as llm:
        outputs = llm.generate(prompts, params)
    import hesitant

    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert sorted(hesitant.ASKED.values()) == [3, 3]


STASH = '''
    import torch
    from weft.contracts.kv_connector import ConnectorOutput, KVConnector

    STORE = {}  # prompt -> {layer: tensor of the prompt's blocks}, kept by the first engine
    SEEN = {"parked": [], "polls": 0}


    class StashConnector(KVConnector):
        """Keeps each prompt's KV in this process after its prefill; a later engine receives it asynchronously,
        a few steps after admission (or is told it failed, for prompts starting with token 13)."""

        name = "stash"

        def __init__(self, *args):
            super().__init__(*args)
            self.parked, self.saves, self.receiving, self.caches = {}, [], {}, None

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if request.prompt_token_ids not in STORE:
                return 0, False
            return len(request.prompt_token_ids) - 1 - num_computed_tokens, True

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            if num_external_tokens:
                self.parked[request.request_id] = (request.prompt_token_ids, block_ids[0])
            else:
                self.saves.append(request)

        def build_connector_meta(self, step):
            saves = [(r.request_id, list(r.prompt_token_ids), list(s.block_ids[0])) for s in step.requests
                     for r in self.saves if r.request_id == s.request_id and s.num_computed_tokens == 0]
            self.saves = [r for r in self.saves if r.request_id not in {s[0] for s in saves}]
            parked = [(request_id, list(prompt), list(blocks)) for request_id, (prompt, blocks) in self.parked.items()]
            self.parked.clear()
            return {"saves": saves, "parked": parked}

        def register_kv_caches(self, kv_caches):
            self.caches = kv_caches

        def bind_connector_metadata(self, metadata):
            self.metadata = metadata

        def start_load_kv(self):
            for request_id, prompt, blocks in (self.metadata or {}).get("parked", []):
                SEEN["parked"].append(request_id)
                self.receiving[request_id] = [tuple(prompt), blocks, 3]  # arrives after 3 more reports

        def wait_for_save(self):
            for request_id, prompt, blocks in (self.metadata or {}).get("saves", []):
                STORE[tuple(prompt)] = {layer: cache[:, blocks].clone() for layer, cache in self.caches.items()}

        def get_finished(self, finished_request_ids):
            SEEN["polls"] += 1
            arrived, failed = set(), set()
            for request_id, entry in list(self.receiving.items()):
                entry[2] -= 1
                if entry[2] > 0:
                    continue
                del self.receiving[request_id]
                prompt, blocks, _ = entry
                if prompt[0] == 13:
                    failed.add(request_id)
                    continue
                for layer, cache in self.caches.items():
                    cache[:, blocks] = STORE[prompt][layer][:, : len(blocks)]
                arrived.add(request_id)
            return ConnectorOutput(finished_receiving=frozenset(arrived), failed_loads=frozenset(failed))
'''


def test_an_asynchronous_load_parks_the_request_outside_the_batch_until_its_kv_arrives_or_fails(
    tiny, site, monkeypatch
):
    site.add_distribution(
        "weft-stash",
        requires=("weft-core>=1.3,<2",),
        entry_points={"weft.kv_connector": {"stash": "stash:StashConnector"}},
        modules={"stash": STASH},
    )
    monkeypatch.syspath_prepend(str(site.root))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [13, 10, 11] * 7, [21, 22] * 20]
    engine = {"num_kv_blocks": 64, "max_model_len": 128, "block_size": 16}
    expected = [output.outputs[0].token_ids for output in LLM(model=str(tiny), engine=engine).generate(prompts, params)]
    with LLM(model=str(tiny), engine=engine, use={"kv_connector": "stash"}) as first:  # computes and stashes
        first.generate(prompts, params)
    import stash

    with LLM(model=str(tiny), engine=engine, use={"kv_connector": "stash"}) as second:
        scheduler = second.engine.core.scheduler
        parked_sizes = []
        step = second.engine.core.step

        def watching():
            parked_sizes.append((len(scheduler.receiving), len(scheduler.running)))
            return step()

        second.engine.core.step = watching
        outputs = second.generate(prompts, params)
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert len(stash.SEEN["parked"]) == 3
    assert (3, 0) in parked_sizes  # all three waited outside the running batch
    # The two that arrived computed only their last prompt token; the failed one computed its prompt.
    assert [output.num_cached_tokens for output in outputs] == [len(prompts[0]) - 1, 0, len(prompts[2]) - 1]


RECORDER = '''
    from weft.contracts.kv_connector import KVConnector

    EVENTS = []
    FIRST_BLOCKS = {}  # a prompt's first block -> {layer: its KV}, kept by the worker role


    class RecorderConnector(KVConnector):
        """Keeps the KV of each prompt's first block once computed and offers it, synchronously, to a later
        request starting with the same block; records when the engine waits for each layer's load."""

        name = "recorder"

        def __init__(self, *args):
            super().__init__(*args)
            self.size = self.groups[0].spec.block_size
            self.prompts, self.caches, self.metadata = {}, None, None

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            known = num_computed_tokens == 0 and request.prompt_token_ids[: self.size] in FIRST_BLOCKS
            return (self.size, False) if known else (0, False)

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            self.prompts[request.request_id] = request.prompt_token_ids[: self.size]

        def build_connector_meta(self, step):
            loads = [(self.prompts[item.request_id], item.block_ids[0][0]) for item in step.requests
                     if item.num_external_tokens]
            saves = [(self.prompts[item.request_id], item.block_ids[0][0]) for item in step.requests
                     if item.num_computed_tokens == 0 and item.num_new_tokens > self.size]
            return {"loads": loads, "saves": saves}

        def register_kv_caches(self, kv_caches):
            self.caches = kv_caches

        def bind_connector_metadata(self, metadata):
            self.metadata = metadata

        def start_load_kv(self):
            EVENTS.append(("start", None))
            for block, index in (self.metadata or {}).get("loads", []):
                for layer, cache in self.caches.items():
                    cache[:, index] = FIRST_BLOCKS[tuple(block)][layer]

        def wait_for_layer_load(self, layer_name):
            EVENTS.append(("wait", layer_name))

        def save_kv_layer(self, layer_name, kv_cache):
            EVENTS.append(("save", layer_name))

        def wait_for_save(self):
            for block, index in (self.metadata or {}).get("saves", []):
                FIRST_BLOCKS[tuple(block)] = {layer: cache[:, index].clone() for layer, cache in self.caches.items()}
'''


def test_each_layer_is_waited_for_in_the_forward_just_before_its_attention_only_in_a_step_that_loads(
    tiny, site, monkeypatch
):
    """Core API 1.9: a layer's wait comes after the previous layer's attention ran, so a connector that lands
    layers one after another lets the first layers compute while later ones arrive; and every layer is
    waited for once per step, before any save. Core API 1.11: only in a step that loads synchronously
    (``SchedulerOutput.has_sync_kv_loads``); in the others nothing the forward reads is arriving."""
    from weft.layers.attention import Attention

    site.add_distribution(
        "weft-recorder",
        entry_points={"weft.kv_connector": {"recorder": "recorder:RecorderConnector"}},
        modules={"recorder": RECORDER},
    )
    monkeypatch.syspath_prepend(str(site.root))
    import recorder

    forward = Attention.forward

    def recorded(self, query, key, value, context):
        output = forward(self, query, key, value, context)
        recorder.EVENTS.append(("attention", self.layer_name))  # this layer's attention ran
        return output

    monkeypatch.setattr(Attention, "forward", recorded)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 5  # one full block of 16 and four tokens
    engine = {"num_kv_blocks": 64, "block_size": 16, "enable_prefix_caching": False}
    expected = LLM(model=str(tiny), engine=engine).generate([prompt], params)[0].outputs[0].token_ids
    recorder.EVENTS.clear()
    with LLM(model=str(tiny), engine=engine, use={"kv_connector": "recorder"}) as llm:
        assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected  # computes and keeps block 0
        assert set(recorder.FIRST_BLOCKS) == {tuple(prompt[:16])}
        loaded = llm.generate([prompt], params)[0]  # loads block 0 in its first step
        assert loaded.outputs[0].token_ids == expected and loaded.num_cached_tokens == 16
        layers = list(llm.engine.runner.kv_caches)
    steps, step = [], None
    for event in recorder.EVENTS:
        if event[0] == "start":
            step = []
            steps.append(step)
        elif step is not None:
            step.append(event)
    waited = [event for layer in layers for event in (("wait", layer), ("attention", layer))]
    not_waited = [("attention", layer) for layer in layers]
    saves = [("save", layer) for layer in layers]
    assert len(steps) == 6 and len(layers) == 2
    assert steps == [not_waited + saves] * 3 + [waited + saves] + [not_waited + saves] * 2


SILENT = '''
    from weft.contracts.kv_connector import KVConnector


    class SilentConnector(KVConnector):
        """Offers every prompt's KV as an asynchronous load, then never reports it (a peer that went quiet)."""

        name = "silent"

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return len(request.prompt_token_ids) - 1 - num_computed_tokens, True
'''


def test_a_load_the_connector_never_reports_is_computed_once_past_kv_load_timeout(tiny, site, monkeypatch):
    import time

    site.add_distribution(
        "weft-silent",
        requires=("weft-core>=1.3,<2",),
        entry_points={"weft.kv_connector": {"silent": "silent:SilentConnector"}},
        modules={"silent": SILENT},
    )
    monkeypatch.syspath_prepend(str(site.root))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [21, 22] * 20]
    engine = {"num_kv_blocks": 64, "max_model_len": 128, "block_size": 16}
    expected = [output.outputs[0].token_ids for output in LLM(model=str(tiny), engine=engine).generate(prompts, params)]
    timeout = 1.0
    with LLM(model=str(tiny), engine={**engine, "kv_load_timeout": timeout}, use={"kv_connector": "silent"}) as llm:
        began = time.monotonic()
        outputs = llm.generate(prompts, params)
        took = time.monotonic() - began
        stats = llm.engine.core.stats()
    assert [output.outputs[0].token_ids for output in outputs] == expected
    assert [output.num_cached_tokens for output in outputs] == [0, 0]  # computed, none loaded
    assert timeout <= took < timeout + 10
    assert (stats.kv_load_timeouts, stats.kv_transfers_failed, stats.kv_transfers_arrived) == (2, 2, 0)
    assert stats.connector_failed_load_tokens == sum(len(prompt) - 1 for prompt in prompts)
