"""The KV-connector contract suite (:mod:`weft.contracts.kv_connector`): the kit's largest, in a module of its own.

Subclass :class:`KVConnectorContract`, set ``plugin_name``, ``connector_options`` and ``model_source``, run pytest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from weft.testing.suites import _Contract


class KVConnectorContract(_Contract):
    """The KV-connector contract (:mod:`weft.contracts.kv_connector`).

    Provide ``connector_options`` (the ``[plugins.<name>]`` table, e.g. pointing at a
    store the test started; JSON-encodable, since an engine in a second process gets
    it too) and ``model_source`` (a small checkpoint an installed loader accepts).
    Every engine case compares greedy output with the same engine without the
    connector. Any connector keeps that output when requests are preempted. A
    connector that stores prefixes for later engines keeps ``stores_prefixes = True``:
    then later engines, in this process or after one in another process, load what
    earlier ones saved (through chunked prefill too), and a load the kit makes fail
    (:mod:`weft.testing.connector_probe`) is recomputed.
    """

    slot = "kv_connector"
    stores_prefixes: ClassVar[bool] = True
    block_size: ClassVar[int] = 16

    @pytest.fixture
    def connector_options(self) -> dict[str, Any]:
        raise NotImplementedError("define a `connector_options` fixture returning your [plugins.<name>] table")

    @pytest.fixture
    def model_source(self) -> str:
        raise NotImplementedError("define a `model_source` fixture returning a small checkpoint")

    @pytest.fixture
    def build(self, plugin, connector_options):
        import uuid

        import msgspec

        from weft.contracts.kv_connector import ConnectorContext

        options = msgspec.convert(connector_options, plugin.Options)
        context = ConnectorContext(model=f"conformance-{uuid.uuid4().hex}")  # nothing stored matches it
        built = []

        def build(role, groups):
            connector = plugin(options, role, groups, context)
            built.append(connector)
            return connector

        yield build
        for connector in built:
            connector.close()

    @staticmethod
    def _groups(block_size: int, ring_block_size: int | None = None):
        from weft.contracts.kv_cache import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

        shape = dict(dtype="float32", num_kv_heads=2, head_dim=8)
        groups = [KVCacheGroupSpec("attention", ("layer.0",), FullAttentionSpec(block_size=block_size, **shape))]
        if ring_block_size is not None:
            ring = SlidingWindowSpec(block_size=ring_block_size, window=24, ring=True, **shape)
            groups.append(KVCacheGroupSpec("window_ring", ("layer.1",), ring))
        return tuple(groups)

    @staticmethod
    def _request(request_id: str, prompt: list[int], groups):
        from weft.contracts.kv_connector import ConnectorRequest, connector_block_size
        from weft.engine.core.kv_cache_manager import block_hashes

        size = connector_block_size(groups)
        return ConnectorRequest(
            request_id=request_id, prompt_token_ids=tuple(prompt), block_hashes=tuple(block_hashes(prompt, size))
        )

    def test_is_a_kv_connector_named_as_registered(self, plugin):
        from weft.contracts.kv_connector import KVConnector

        assert issubclass(plugin, KVConnector), f"{plugin!r} must subclass weft.contracts.kv_connector.KVConnector"
        assert plugin.name == self.plugin_name, (
            f"{plugin.__name__}.name is {plugin.name!r} but its entry point is {self.plugin_name!r}: "
            f"set name = {self.plugin_name!r}, the name users write in use.kv_connector"
        )

    def test_lookup_has_no_side_effects_and_unknown_or_short_prompts_match_nothing(self, build):
        groups = self._groups(self.block_size)
        scheduler = build("scheduler", groups)
        short = self._request("short", list(range(1, self.block_size)), groups)
        assert scheduler.get_num_new_matched_tokens(short, 0) == (0, False)
        unknown = self._request("unknown", list(range(100, 100 + 5 * self.block_size)), groups)
        first = scheduler.get_num_new_matched_tokens(unknown, 0)
        assert first == scheduler.get_num_new_matched_tokens(unknown, 0) == (0, False)

    def test_a_ring_group_with_an_odd_block_size_does_not_break_start_up_or_lookups(self, build):
        groups = self._groups(self.block_size, ring_block_size=3 * self.block_size + 5)
        scheduler, worker = build("scheduler", groups), build("worker", groups)
        request = self._request("ring", list(range(7, 7 + 4 * self.block_size)), groups)
        assert len(request.block_hashes) == 4, "the stored block size comes from the prefix-cacheable groups only"
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert isinstance(worker, type(scheduler))

    def test_step_metadata_is_msgspec_encodable_and_reports_are_connector_outputs(self, build):
        import msgspec

        from weft.contracts.kv_connector import ConnectorOutput, ConnectorStep, ConnectorStepRequest

        groups = self._groups(self.block_size)
        scheduler = build("scheduler", groups)
        request = self._request("meta", list(range(3, 3 + 2 * self.block_size + 3)), groups)
        scheduler.update_state_after_alloc(request, ((0, 1, 2),), 0)
        step = ConnectorStep(requests=(ConnectorStepRequest("meta", 0, len(request.prompt_token_ids), ((0, 1, 2),)),))
        msgspec.msgpack.encode(scheduler.build_connector_meta(step))
        msgspec.msgpack.encode(scheduler.build_connector_meta(ConnectorStep(requests=())))
        delay_free, params = scheduler.request_finished(request, ((0, 1, 2),))
        assert isinstance(delay_free, bool) and (params is None or isinstance(params, dict))
        scheduler.update_connector_output(ConnectorOutput(finished_sending=frozenset({"meta"})))

    # Engine cases. Each has prompts of its own, so no case finds another's blocks.

    def _engine(self, **overrides: Any) -> dict[str, Any]:
        return {"block_size": self.block_size, "num_kv_blocks": 64, "max_model_len": 256, **overrides}

    def _connected(
        self, model_source: str, connector_options: dict[str, Any], engine: dict[str, Any]
    ) -> dict[str, Any]:
        """``LLM`` arguments for an engine with the connector under test."""
        return dict(
            model=model_source,
            engine=engine,
            use={"kv_connector": self.plugin_name},
            plugins={self.plugin_name: connector_options},
        )

    def _probed_llm(self, plugin, connected: dict[str, Any], fail_loads: bool = False):
        """An engine whose connector is ``plugin`` watched by the kit (:mod:`weft.testing.connector_probe`)."""
        from weft.config import load_config
        from weft.entrypoints.llm import LLM
        from weft.testing.connector_probe import ProbeRegistry, probed

        watched = probed(plugin, fail_loads=fail_loads)
        registry = ProbeRegistry(self.plugin_name, watched)
        return LLM(config=load_config(None, connected, registry=registry), registry=registry), watched.kit_probe

    @staticmethod
    def _prompt(case: int, length: int) -> list[int]:
        return [(131 * case + 37 * i) % 997 + 3 for i in range(length)]

    @staticmethod
    def _generate(llm, prompts: list[list[int]], max_tokens: int = 6):
        from weft.sampling_params import SamplingParams

        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))

    def _reference(self, model_source: str, engine: dict[str, Any], prompts: list[list[int]], max_tokens: int = 6):
        """Greedy tokens of the same engine without a connector."""
        from weft.entrypoints.llm import LLM

        with LLM(model=model_source, engine=engine) as plain:
            return [output.outputs[0].token_ids for output in self._generate(plain, prompts, max_tokens)]

    def _skip_unless_storing(self) -> None:
        if not self.stores_prefixes:
            pytest.skip("this connector does not store prefixes for later engines")

    @staticmethod
    def _assert_loaded(output, at_least: int) -> None:
        cached, length = output.num_cached_tokens, len(output.prompt_token_ids)
        assert at_least <= cached < length, (
            f"the later engine reused {cached} of the prompt's {length} tokens; it should have loaded at least "
            f"the {at_least} tokens of full blocks an earlier engine saved (and never the last token)"
        )

    def _saved_then_loaded(
        self, model_source, connector_options, engine, saved: list[int], loaded: list[int], at_least: int
    ):
        """A first engine generates for ``saved``, a second for ``loaded``, loading ``at_least`` tokens the first
        saved."""
        from weft.entrypoints.llm import LLM

        expected = self._reference(model_source, engine, [saved, loaded])
        connected = self._connected(model_source, connector_options, engine)
        with LLM(**connected) as first:
            assert self._generate(first, [saved])[0].outputs[0].token_ids == expected[0]
        with LLM(**connected) as second:
            output = self._generate(second, [loaded])[0]
        assert output.outputs[0].token_ids == expected[1]
        self._assert_loaded(output, at_least)

    def test_a_second_engine_reuses_what_the_first_stored(self, connector_options, model_source):
        """A prompt of whole blocks: the one holding the last token is computed, never loaded (the engine raises)."""
        self._skip_unless_storing()
        prompt = self._prompt(1, 3 * self.block_size)
        self._saved_then_loaded(model_source, connector_options, self._engine(), prompt, prompt, 2 * self.block_size)

    def test_chunked_prefill_saves_and_loads(self, connector_options, model_source):
        """Prompts longer than a step's token budget, whose chunks end inside blocks."""
        self._skip_unless_storing()
        engine = self._engine(max_num_batched_tokens=self.block_size + 8)
        shared = self._prompt(2, 5 * self.block_size)
        saved, loaded = shared + self._prompt(3, 4), shared + self._prompt(4, 2 * self.block_size - 2)
        self._saved_then_loaded(model_source, connector_options, engine, saved, loaded, 5 * self.block_size)

    def test_a_failed_load_is_recomputed(self, plugin, connector_options, model_source):
        """The kit poisons the blocks the connector loaded and reports the load failed."""
        self._skip_unless_storing()
        from weft.entrypoints.llm import LLM

        engine = self._engine()
        prompt = self._prompt(5, 3 * self.block_size + 4)
        expected = self._reference(model_source, engine, [prompt])
        connected = self._connected(model_source, connector_options, engine)
        with LLM(**connected) as first:
            self._generate(first, [prompt])
        failing, probe = self._probed_llm(plugin, connected, fail_loads=True)
        with failing:
            output = self._generate(failing, [prompt])[0]
        assert probe.loads, "the connector loaded nothing for a prompt an earlier engine saved, so no load could fail"
        assert probe.failed == [load.request_id for load in probe.loads]
        assert output.outputs[0].token_ids == expected[0], "the engine must recompute the tokens whose load failed"
        assert output.num_cached_tokens == 0, "tokens whose load failed were counted as cached"

    def test_preempted_requests_keep_their_output(self, plugin, connector_options, model_source):
        """A KV cache too small for the batch, so requests are preempted.

        The engine's own prefix cache is off: a preempted request comes back through
        the connector (a storing one loads what it saved) or is recomputed.
        """
        engine = self._engine(num_kv_blocks=16, enable_prefix_caching=False)
        prompts = [self._prompt(6 + p, 5 * self.block_size + 10 + 5 * p) for p in range(4)]
        expected = self._reference(model_source, engine, prompts, max_tokens=32)
        llm, probe = self._probed_llm(plugin, self._connected(model_source, connector_options, engine))
        with llm:
            outputs = self._generate(llm, prompts, max_tokens=32)
        assert probe.preempted, "no request was preempted; the case needs a smaller engine.num_kv_blocks"
        assert [output.outputs[0].token_ids for output in outputs] == expected

    def test_a_second_process_saves_and_this_one_loads(self, connector_options, model_source):
        self._skip_unless_storing()
        from weft.entrypoints.llm import LLM

        engine = self._engine()
        prompt = self._prompt(10, 3 * self.block_size + 4)
        expected = self._reference(model_source, engine, [prompt])
        connected = self._connected(model_source, connector_options, engine)
        code = (
            "import json, sys\n"
            "from weft import LLM, SamplingParams\n"
            "with LLM(**json.loads(sys.argv[1])) as llm:\n"
            "    llm.generate([json.loads(sys.argv[2])], SamplingParams(temperature=0, max_tokens=1))\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code, json.dumps(connected), json.dumps(prompt)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"the engine in the second process failed:\n{result.stderr[-3000:]}"
        with LLM(**connected) as later:
            output = self._generate(later, [prompt])[0]
        assert output.outputs[0].token_ids == expected[0]
        self._assert_loaded(output, 3 * self.block_size)
