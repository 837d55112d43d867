"""Contract test suites, one class per slot. Subclass one, set ``plugin_name``, run pytest."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from weft.contracts import SLOT_GROUPS

_KNOWN_DTYPES = {"float32", "float16", "bfloat16", "float64"}
_DISTRIBUTED_BACKENDS = {"gloo", "nccl", "xccl", "mpi", "hccl", "ucc"}


def _run_isolated(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; it must print one JSON object."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"isolated check failed:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _platform_under_test(weft_registry, name: str | None) -> Any:
    """An instance of platform ``name`` (skipping the test, with the probe's reason, where it is not
    available), or of the platform ``use.platform = "auto"`` would choose when ``name`` is None."""
    from weft.plugins.selection import select_platform

    if name is None:
        platform_class, _ = select_platform(weft_registry)
        return platform_class()
    platform_class = weft_registry.load("platform", name)
    probe = platform_class.probe()
    if not probe.available:
        pytest.skip(f"platform {name!r} is not available here: {probe.reason}")
    return platform_class()


class _Contract:
    slot: ClassVar[str]
    plugin_name: ClassVar[str]
    """The entry-point name of the plugin under test. Set it in the subclass."""

    @pytest.fixture
    def entry(self, weft_registry):
        return weft_registry.find(self.slot, self.plugin_name)

    @pytest.fixture
    def plugin(self, weft_registry):
        return weft_registry.load(self.slot, self.plugin_name)

    def test_registered_under_its_slot(self, entry):
        assert self.slot in SLOT_GROUPS
        assert entry.status == "ok", entry.problem
        assert entry.builtin or entry.core_api, "the distribution must declare a weft-core range"

    def test_options_are_a_frozen_struct_with_defaults_or_required_fields(self, plugin):
        import msgspec

        from weft.contracts.plugin import NoOptions

        options = getattr(plugin, "Options", NoOptions)
        assert issubclass(options, msgspec.Struct), "Options must be a msgspec.Struct"
        assert options.__struct_config__.frozen, "Options must be frozen (msgspec.Struct, frozen=True)"
        assert options.__struct_config__.forbid_unknown_fields, "Options must set forbid_unknown_fields=True"


class PlatformContract(_Contract):
    """The platform contract (:mod:`weft.contracts.platform`)."""

    slot = "platform"

    def test_module_import_and_probe_import_no_torch(self, entry):
        module, _, attribute = entry.target.partition(":")
        code = (
            "import importlib, json, sys\n"
            f"platform = getattr(importlib.import_module({module.strip()!r}), {attribute.strip()!r})\n"
            "after_import = 'torch' in sys.modules\n"
            "probe = platform.probe()\n"
            "print(json.dumps({'after_import': after_import, 'after_probe': 'torch' in sys.modules,"
            " 'available': probe.available}))\n"
        )
        result = _run_isolated(code)
        assert not result["after_import"], "importing the platform module imported torch"
        assert not result["after_probe"], "probe() imported torch; probes must not initialise a device runtime"

    def test_class_attributes(self, plugin):
        from weft.contracts.platform import Platform

        assert issubclass(plugin, Platform)
        assert plugin.name == self.plugin_name, "the class's name must equal its entry-point name"
        assert isinstance(plugin.device_type, str) and plugin.device_type
        assert plugin.supported_dtypes and set(plugin.supported_dtypes) <= _KNOWN_DTYPES
        assert plugin.distributed_backend in _DISTRIBUTED_BACKENDS
        assert isinstance(plugin.default_attention, str) and plugin.default_attention

    def test_probe_reports_a_reason(self, plugin):
        from weft.contracts.platform import PlatformProbe

        probe = plugin.probe()
        assert isinstance(probe, PlatformProbe)
        assert probe.reason.strip(), "a probe must say why it is or is not available"
        assert probe.device_count >= 0

    @pytest.fixture
    def available(self, plugin):
        """An instance of the platform; the test is skipped, with the probe's reason, where it is not available."""
        probe = plugin.probe()
        if not probe.available:
            pytest.skip(f"platform {self.plugin_name!r} is not available here: {probe.reason}")
        return plugin()

    def test_memory_info_when_available(self, available):
        info = available.memory_info(0)
        assert 0 < info.total and 0 <= info.free <= info.total

    def test_device_computes_when_available(self, available):
        import torch

        assert available.default_dtype() in available.supported_dtypes
        dtype = getattr(torch, available.default_dtype())
        values = torch.arange(1, 9, device=available.select_device(0)).to(dtype)
        assert values.device.type == available.device_type
        assert (values * 2).sum().item() == 72

    def test_distributed_backend_is_built_when_available(self, available):
        import torch.distributed

        assert torch.distributed.is_available() and torch.distributed.is_backend_available(available.distributed_backend), (
            f"the installed torch has no {available.distributed_backend!r} backend for platform {self.plugin_name!r}"
        )

    def test_graph_capture_replays_when_declared(self, available):
        if not available.supports_graph_capture:
            pytest.skip(f"platform {self.plugin_name!r} declares no graph capture")
        import torch

        source = torch.arange(4, dtype=torch.float32, device=available.device(0))
        target = torch.zeros_like(source)
        replay = available.capture_graph(lambda: target.copy_(source * 2))
        source.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
        assert replay().tolist() == [10.0, 12.0, 14.0, 16.0]


class TokenizerContract(_Contract):
    """The tokenizer contract (:mod:`weft.contracts.tokenizer`). Provide a ``tokenizer`` fixture."""

    slot = "tokenizer"
    round_trip_texts: ClassVar[tuple[str, ...]] = (
        "Hello, world!",
        "  leading and trailing spaces  ",
        "naïve café, Grüße, 图片🌍 and ∑ symbols",
        "line one\nline two\ttabbed",
        "",
    )
    """Texts ``decode(encode(text))`` must reproduce exactly; override for normalising tokenizers."""

    @pytest.fixture
    def tokenizer(self, plugin):
        raise NotImplementedError("define a `tokenizer` fixture returning an instance of the plugin")

    def test_is_a_tokenizer(self, tokenizer, plugin):
        from weft.contracts.tokenizer import Tokenizer

        assert isinstance(tokenizer, plugin) and isinstance(tokenizer, Tokenizer)

    def test_round_trip(self, tokenizer):
        for text in self.round_trip_texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
            assert tokenizer.decode(ids) == text

    def test_eos_ids_are_in_the_vocabulary(self, tokenizer):
        assert tokenizer.eos_token_ids, "a tokenizer must name at least one end-of-sequence id"
        assert all(0 <= i < tokenizer.vocab_size for i in tokenizer.eos_token_ids)

    def test_streaming_never_splits_characters(self, tokenizer):
        for text in self.round_trip_texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            stream = tokenizer.detokenizer()
            pieces = [stream.push(i) for i in ids] + [stream.flush()]
            assert "".join(pieces) == tokenizer.decode(ids)
            assert all("\ufffd" not in piece for piece in pieces[:-1]), pieces

    def test_message_normalisation_keeps_input_and_accepts_response_parts(self, tokenizer):
        parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
        messages = [{"role": "user", "content": parts}]
        snapshot = json.dumps(messages)
        normalized = tokenizer.normalize_messages(messages)
        assert json.dumps(messages) == snapshot, "normalize_messages mutated its input"
        for kind in ("input_text", "output_text"):
            other = [{"role": "user", "content": [{"type": kind, "text": p["text"]} for p in parts]}]
            assert tokenizer.normalize_messages(other) == normalized
        with pytest.raises(ValueError, match="audio"):
            tokenizer.normalize_messages([{"role": "user", "content": [{"type": "audio", "data": ""}]}])

    def test_chat_template_renders_the_messages(self, tokenizer):
        messages = tokenizer.normalize_messages([{"role": "user", "content": "What is the capital of France?"}])
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(prompt, str) and "What is the capital of France?" in prompt


class OpContract(_Contract):
    """The ops contract (:mod:`weft.contracts.ops`): an implementation equals the op's reference.

    ``plugin_name`` is ``"<op>.<implementation>"``. Set ``platform`` to run the
    comparison on that platform's device (skipped, with the reason, where it is
    not available), or ``device`` to run it on another torch device than the
    CPU under the platform ``auto`` chooses.
    """

    slot = "ops"
    device: ClassVar[str] = "cpu"
    platform: ClassVar[str | None] = None

    @pytest.fixture
    def reference(self, weft_registry, plugin):
        candidates = [
            impl for impl in weft_registry.load_all("ops", prefix=f"{plugin.op}.").values() if impl.reference
        ]
        assert len(candidates) == 1, f"op {plugin.op!r} must have exactly one reference, found {len(candidates)}"
        return candidates[0]

    def test_name_matches_the_op(self, plugin):
        from weft.contracts.ops import OpImplementation

        assert issubclass(plugin, OpImplementation)
        assert self.plugin_name.partition(".")[0] == plugin.op

    def test_matches_the_reference(self, plugin, reference, weft_registry):
        if importlib.util.find_spec("torch") is None:
            pytest.skip("torch is not installed")
        import torch

        platform = _platform_under_test(weft_registry, self.platform)
        if not plugin.runs_on(platform.name) or not plugin.is_available(platform):
            pytest.skip(f"{self.plugin_name} does not run on platform {platform.name!r}")
        implementation, expected_impl = plugin(platform), reference(platform)
        rtol, atol = plugin.tolerance
        device = str(platform.device(0)) if self.platform is not None else self.device
        cases = list(reference.example_inputs(device))
        assert cases, "the reference must provide example inputs"
        for args, kwargs in cases:
            expected = expected_impl(*args, **kwargs)
            actual = implementation(*args, **kwargs)
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


class HooksContract(_Contract):
    """The hooks contract (:mod:`weft.contracts.hooks`): every hook implementation matches a spec."""

    slot = "hooks"

    def test_implements_known_hooks_only(self, plugin):
        import pluggy

        from weft.contracts import hooks as hookspecs

        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        manager.register(plugin, name=self.plugin_name)
        manager.check_pending()
        implemented = [caller.name for caller in manager.get_hookcallers(plugin) or ()]
        assert implemented, "a hooks plugin must implement at least one hook"


class LoaderContract(_Contract):
    """The weight-loader contract (:mod:`weft.contracts.loader`). Provide a ``model_source`` fixture (a string)."""

    slot = "loader"

    @pytest.fixture
    def model_source(self) -> str:
        raise NotImplementedError("define a `model_source` fixture returning a model string your loader accepts")

    @pytest.fixture
    def loader(self, plugin):
        return plugin()

    def test_accepts_its_source_and_refuses_others_without_raising(self, loader, model_source, tmp_path):
        assert loader.accepts(model_source)
        for other in (str(tmp_path / "missing"), str(tmp_path), "", "\x00", "not/a-real-repo-xyz"):
            assert loader.accepts(other) in (True, False)
        assert not loader.accepts(str(tmp_path / "missing"))

    def test_resolve_describes_the_model(self, loader, model_source, weft_registry):
        from pathlib import Path

        from weft.contracts.loader import ModelSource

        source = loader.resolve(model_source)
        assert isinstance(source, ModelSource)
        assert Path(source.path).is_absolute() and Path(source.path).exists()
        assert source.hf_config.get("architectures"), "hf_config must name the architectures"
        assert source.name
        weft_registry.find("tokenizer", source.tokenizer)

    def test_resolve_refuses_a_missing_model_with_a_value_error(self, loader, tmp_path):
        with pytest.raises(ValueError):
            loader.resolve(str(tmp_path / "missing"))

    def test_weights_come_once_each_in_the_asked_dtype(self, loader, model_source):
        import torch

        source = loader.resolve(model_source)
        names = []
        for name, tensor in loader.iter_weights(source, "float32"):
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32, name
            names.append(name)
        assert names and len(names) == len(set(names))


class AttentionContract(_Contract):
    """The attention-backend contract (:mod:`weft.contracts.attention`), against a plain reference.

    Two engine steps run through the backend: first every request prefills part
    of its prompt, then one continues its prefill, others decode and one starts
    fresh. Each step's output is compared with softmax attention computed from
    the whole key/value history the suite keeps itself. Set ``platform`` to run
    on that platform's device (skipped, with the reason, where it is not
    available), or ``device`` under the platform ``auto`` chooses; and
    ``dtype``/``tolerance`` for accelerators.
    """

    slot = "attention"
    device: ClassVar[str] = "cpu"
    platform: ClassVar[str | None] = None
    dtype: ClassVar[str] = "float32"
    tolerance: ClassVar[tuple[float, float]] = (1e-4, 1e-4)
    head_dims: ClassVar[tuple[int, ...]] = (64, 128)
    block_size: ClassVar[int] = 16

    @pytest.fixture
    def target_platform(self, weft_registry):
        return _platform_under_test(weft_registry, self.platform)

    @pytest.fixture
    def backend(self, plugin, target_platform):
        return plugin(None, target_platform)

    @pytest.mark.parametrize("window", [None, 20])
    @pytest.mark.parametrize("head_dim_index", [0, 1])
    def test_mixed_prefill_and_decode_steps_match_the_reference(self, backend, target_platform, window, head_dim_index):
        if head_dim_index >= len(self.head_dims):
            pytest.skip("fewer head sizes declared")
        import torch

        from weft.contracts.attention import AttentionBatch, AttentionLayer
        from weft.contracts.kv_cache import FullAttentionSpec

        head_dim = self.head_dims[head_dim_index]
        device = target_platform.device(0) if self.platform is not None else torch.device(self.device)
        dtype = getattr(torch, self.dtype)
        layer = AttentionLayer(num_heads=4, num_kv_heads=2, head_dim=head_dim, scale=head_dim**-0.5, sliding_window=window)
        backend.prepare([layer], self.dtype)
        spec = FullAttentionSpec(block_size=self.block_size, dtype=self.dtype, num_kv_heads=2, head_dim=head_dim)
        per_request = -(-40 // self.block_size)  # every request stays under 40 tokens
        num_blocks = 8 * per_request
        kv_cache = torch.zeros(backend.kv_cache_shape(num_blocks, spec), dtype=dtype, device=device)
        generator = torch.Generator().manual_seed(head_dim + (window or 0))
        blocks = torch.randperm(num_blocks, generator=generator).tolist()
        tables = [blocks[i * per_request : (i + 1) * per_request] for i in range(4)]
        history: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {r: ([], []) for r in range(4)}
        # (request, tokens already cached, new tokens) per step; request 3 starts in step 2.
        steps = [[(0, 0, 37), (1, 0, 5), (2, 0, 16)], [(0, 37, 1), (1, 5, 20), (2, 16, 1), (3, 0, 9)]]
        for step in steps:
            total = sum(new for _, _, new in step)
            query = torch.randn(total, 4, head_dim, generator=generator).to(dtype).to(device)
            key = torch.randn(total, 2, head_dim, generator=generator).to(dtype).to(device)
            value = torch.randn(total, 2, head_dim, generator=generator).to(dtype).to(device)
            starts, slots = [0], []
            for request, cached, new in step:
                for position in range(cached, cached + new):
                    slots.append(tables[request][position // self.block_size] * self.block_size + position % self.block_size)
                starts.append(starts[-1] + new)
            width = max(len(table) for table in tables)
            batch = AttentionBatch(
                query_start=torch.tensor(starts, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([cached + new for _, cached, new in step], dtype=torch.int32, device=device),
                block_table=torch.tensor([tables[r] + [0] * (width - len(tables[r])) for r, _, _ in step], dtype=torch.int32, device=device),
                slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
                max_query_len=max(new for _, _, new in step),
                max_seq_len=max(cached + new for _, cached, new in step),
                block_size=self.block_size,
            )
            output = backend.forward(layer, query, key, value, kv_cache, backend.build_metadata(batch))
            for index, (request, cached, new) in enumerate(step):
                rows = slice(starts[index], starts[index + 1])
                history[request][0].append(key[rows].float().cpu())
                history[request][1].append(value[rows].float().cpu())
                keys, values = torch.cat(history[request][0]), torch.cat(history[request][1])
                expected = _reference_attention(query[rows].float().cpu(), keys, values, cached, layer)
                rtol, atol = self.tolerance
                torch.testing.assert_close(output[rows].float().cpu(), expected, rtol=rtol, atol=atol)


def _reference_attention(query, keys, values, first_position, layer):
    """Causal softmax attention of queries at positions ``first_position...`` over ``keys``/``values``."""
    import torch

    group = layer.num_heads // layer.num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * layer.scale
    query_positions = torch.arange(first_position, first_position + query.shape[0]).unsqueeze(1)
    key_positions = torch.arange(keys.shape[0]).unsqueeze(0)
    visible = key_positions <= query_positions
    if layer.sliding_window is not None:
        visible &= key_positions > query_positions - layer.sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


class ModelContract(_Contract):
    """The model-family contract (:mod:`weft.contracts.model`), on a checkpoint the author provides.

    ``plugin_name`` is the Hugging Face architecture the family registers; give a
    ``model_source`` fixture (a string an installed loader accepts) holding a small
    checkpoint of that architecture.
    """

    slot = "model"
    block_size: ClassVar[int] = 16

    @pytest.fixture
    def model_source(self) -> str:
        raise NotImplementedError("define a `model_source` fixture returning a small checkpoint of your architecture")

    @pytest.fixture
    def parts(self, plugin, model_source, weft_registry):
        from weft.contracts.model import ModelConfig

        classes = sorted(weft_registry.load_all("loader").values(), key=lambda loader_class: -loader_class.priority)
        loader = next((candidate for candidate in (cls() for cls in classes) if candidate.accepts(model_source)), None)
        assert loader is not None, f"no installed loader accepts {model_source!r}"
        source = loader.resolve(model_source)
        assert self.plugin_name in source.hf_config.get("architectures", []), "the checkpoint is of another architecture"
        config = ModelConfig(
            architecture=self.plugin_name, hf_config=source.hf_config, dtype="float32", block_size=self.block_size,
            max_model_len=min(source.hf_config.get("max_position_embeddings", 512), 512),
        )
        return plugin(), loader, source, config

    def test_kv_cache_groups_cover_every_attention_layer_once(self, parts):
        import torch

        from weft.contracts.kv_cache import KVCacheGroupSpec
        from weft.layers.attention import Attention

        family, _, _, config = parts
        groups = family.kv_cache_groups(config)
        assert groups and all(isinstance(group, KVCacheGroupSpec) for group in groups)
        every = [name for group in groups for name in group.layer_names]
        assert all(group.layer_names for group in groups), "every KV-cache group must hold at least one layer"
        assert len(every) == len(set(every)), "a cache tensor name (layer name) may appear in one group only"
        module = family.build(config, torch.device("cpu"))
        layers = [m.layer_name for m in module.modules() if isinstance(m, Attention)]
        # Groups the attention backend owns are read through weft's Attention layers; the others
        # (compressed entries, recurrent state, rings) are read by the model itself.
        declared = [name for group in groups if group.spec.paged_attention for name in group.layer_names]
        assert sorted(declared) == sorted(layers), "every attention layer must be in exactly one KV-cache group"
        for index, group in enumerate(groups):
            for layer in module.modules():
                if isinstance(layer, Attention) and layer.layer_name in group.layer_names:
                    assert layer.group == index, f"{layer.layer_name} reads group {layer.group}, declared in {index}"

    def test_load_weights_refuses_missing_and_unknown_tensors(self, parts):
        import torch

        family, loader, source, config = parts
        weights = list(loader.iter_weights(source, "float32"))
        family.load_weights(family.build(config, torch.device("cpu")), weights)
        with pytest.raises(ValueError):
            family.load_weights(family.build(config, torch.device("cpu")), weights[1:])
        with pytest.raises(ValueError):
            family.load_weights(family.build(config, torch.device("cpu")), [*weights, ("no.such.tensor", torch.zeros(1))])

    def test_generates_through_the_engine(self, model_source):
        from weft.entrypoints.llm import LLM
        from weft.sampling_params import SamplingParams

        llm = LLM(model=model_source, engine={"block_size": self.block_size, "num_kv_blocks": 256, "max_model_len": 256})
        outputs = llm.generate([[5, 6, 7], [8] * 40], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]


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
        from weft.engine.kv_cache_manager import block_hashes

        size = connector_block_size(groups)
        return ConnectorRequest(request_id=request_id, prompt_token_ids=tuple(prompt), block_hashes=tuple(block_hashes(prompt, size)))

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

    def _connected(self, model_source: str, connector_options: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
        """``LLM`` arguments for an engine with the connector under test."""
        return dict(model=model_source, engine=engine, use={"kv_connector": self.plugin_name},
                    plugins={self.plugin_name: connector_options})

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

    def _saved_then_loaded(self, model_source, connector_options, engine, saved: list[int], loaded: list[int], at_least: int):
        """A first engine generates for ``saved``, a second for ``loaded``, loading ``at_least`` tokens the first saved."""
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
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, f"the engine in the second process failed:\n{result.stderr[-3000:]}"
        with LLM(**connected) as later:
            output = self._generate(later, [prompt])[0]
        assert output.outputs[0].token_ids == expected[0]
        self._assert_loaded(output, 3 * self.block_size)


class QuantizationContract(_Contract):
    """The quantization contract (:mod:`weft.contracts.quantization`): a method's ``apply`` equals
    ``x @ dequantize(W)^T + b`` for each weight format, within the method's :attr:`tolerance`
    (relative to the output's largest magnitude).

    The formats checked: GGUF-like 4-bit groups of 32 with an offset (Q4_1, Q4_K) and without
    (Q4_0), 8-bit signed groups (Q8_0), and float weights; each is loaded in two row blocks
    (a stacked q/k/v), as families do. A method that refuses a format raises ValueError at load.
    Set ``platform`` to run on that platform (skipped where not available).
    """

    slot = "quantization"
    platform: ClassVar[str | None] = None
    activation_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    rounded_float_tolerance: ClassVar[float] = 0.1
    """Largest error, relative to the output's magnitude, for float weights the method quantizes itself."""

    @staticmethod
    def weight_formats(out_features: int, in_features: int) -> dict[str, Any]:
        import torch

        from weft.contracts.quantization import GroupAffine

        generator = torch.Generator().manual_seed(0)
        groups = in_features // 32

        def uniform(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=generator) * 0.02 + 0.001

        def codes(low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randint(low, high, (out_features, in_features), generator=generator).to(dtype)

        scales = uniform(out_features, groups)
        return {
            "Q4_0": GroupAffine(codes(0, 16, torch.uint8), scales, -8 * scales, 32, 4, False, "Q4_0"),
            "Q4_1": GroupAffine(codes(0, 16, torch.uint8), uniform(out_features, groups),
                                -uniform(out_features, groups) * 8, 32, 4, False, "Q4_1"),
            "Q8_0": GroupAffine(codes(-128, 128, torch.int8), uniform(out_features, groups) / 8, None, 32, 8, True,
                                "Q8_0"),
            "float": torch.randn(out_features, in_features, generator=generator) * 0.05,
        }

    def test_apply_matches_the_dequantized_reference(self, plugin, weft_registry):
        import torch
        from torch import nn

        from weft.contracts.quantization import GroupAffine, QuantizationMethod

        assert issubclass(plugin, QuantizationMethod)
        platform = _platform_under_test(weft_registry, self.platform)
        if not plugin.is_available(platform):
            pytest.skip(f"quantization {self.plugin_name!r} has no kernels on platform {platform.name!r}")
        out_features, in_features = 96, 256
        rtol, atol = plugin.tolerance
        for dtype in self.activation_dtypes:
            for name, weight in self.weight_formats(out_features, in_features).items():
                method = plugin(platform, dtype)
                layer = nn.Linear(in_features, out_features, bias=True, dtype=getattr(torch, dtype))
                layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)
                method.create_weights(layer, in_features, out_features)
                half = out_features // 2
                try:
                    method.load_weight(layer, weight.narrow(0, half, out_features - half), half, name)
                    method.load_weight(layer, weight.narrow(0, 0, half), 0, name)
                except ValueError:
                    continue  # the method refuses this format, as it may
                method.process_weights_after_loading(layer)
                assert method.describe(layer), "describe() must name the effective format"
                dense = weight.dequantize() if isinstance(weight, GroupAffine) else weight
                x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
                bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
                expected = x @ dense.t() + bias
                actual = method.apply(layer, x.to(getattr(torch, dtype)), bias.to(getattr(torch, dtype)))
                assert actual.dtype == getattr(torch, dtype) and actual.shape == expected.shape
                scale = expected.abs().max()
                error = ((actual.float() - expected).abs() - rtol * expected.abs()).max() / scale
                # Float weights the method rounds itself (to 4 bits at worst): a looser bound.
                assert error <= (self.rounded_float_tolerance if name == "float" else atol), f"{self.plugin_name} on {name} weights, {dtype} activations: error {error:.4f}"
