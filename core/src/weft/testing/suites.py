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

        assert torch.distributed.is_available() and torch.distributed.is_backend_available(
            available.distributed_backend
        ), f"the installed torch has no {available.distributed_backend!r} backend for platform {self.plugin_name!r}"

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
        candidates = [impl for impl in weft_registry.load_all("ops", prefix=f"{plugin.op}.").values() if impl.reference]
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
    ``dtype``/``tolerance`` for accelerators. A backend that declares fp8 caches
    (:attr:`~weft.contracts.attention.AttentionBackend.kv_cache_dtypes`) runs the steps again over a
    float8_e4m3fn cache, against the reference on keys and values rounded as
    :func:`~weft.contracts.attention.to_float8` rounds them.
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

    @pytest.mark.parametrize("kv_cache_dtype", [None, "float8_e4m3fn"])
    @pytest.mark.parametrize("window", [None, 20])
    @pytest.mark.parametrize("head_dim_index", [0, 1])
    def test_mixed_prefill_and_decode_steps_match_the_reference(
        self, backend, target_platform, window, head_dim_index, kv_cache_dtype
    ):
        if head_dim_index >= len(self.head_dims):
            pytest.skip("fewer head sizes declared")
        if kv_cache_dtype is not None and kv_cache_dtype not in backend.kv_cache_dtypes:
            pytest.skip(f"backend {self.plugin_name!r} stores no {kv_cache_dtype} cache")
        import torch

        from weft.contracts.attention import AttentionBatch, AttentionLayer, to_float8
        from weft.contracts.kv_cache import FullAttentionSpec

        head_dim = self.head_dims[head_dim_index]
        device = target_platform.device(0) if self.platform is not None else torch.device(self.device)
        dtype = getattr(torch, self.dtype)
        layer = AttentionLayer(
            num_heads=4, num_kv_heads=2, head_dim=head_dim, scale=head_dim**-0.5, sliding_window=window
        )
        backend.prepare([layer], self.dtype)
        cache_dtype = kv_cache_dtype or self.dtype
        spec = FullAttentionSpec(block_size=self.block_size, dtype=cache_dtype, num_kv_heads=2, head_dim=head_dim)
        per_request = -(-40 // self.block_size)  # every request stays under 40 tokens
        num_blocks = 8 * per_request
        kv_cache = torch.zeros(
            backend.kv_cache_shape(num_blocks, spec), dtype=getattr(torch, cache_dtype), device=device
        )
        # What the cache holds of each key and value: the values themselves, or their float8 rounding.
        stored = (lambda tensor: tensor) if kv_cache_dtype is None else (lambda tensor: to_float8(tensor).float())
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
                    slots.append(
                        tables[request][position // self.block_size] * self.block_size + position % self.block_size
                    )
                starts.append(starts[-1] + new)
            width = max(len(table) for table in tables)
            batch = AttentionBatch(
                query_start=torch.tensor(starts, dtype=torch.int32, device=device),
                seq_lens=torch.tensor([cached + new for _, cached, new in step], dtype=torch.int32, device=device),
                block_table=torch.tensor(
                    [tables[r] + [0] * (width - len(tables[r])) for r, _, _ in step], dtype=torch.int32, device=device
                ),
                slot_mapping=torch.tensor(slots, dtype=torch.int32, device=device),
                max_query_len=max(new for _, _, new in step),
                max_seq_len=max(cached + new for _, cached, new in step),
                block_size=self.block_size,
            )
            output = backend.forward(layer, query, key, value, kv_cache, backend.build_metadata(batch))
            for index, (request, cached, _new) in enumerate(step):
                rows = slice(starts[index], starts[index + 1])
                history[request][0].append(stored(key[rows].float().cpu()))
                history[request][1].append(stored(value[rows].float().cpu()))
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
        assert self.plugin_name in source.hf_config.get("architectures", []), (
            "the checkpoint is of another architecture"
        )
        config = ModelConfig(
            architecture=self.plugin_name,
            hf_config=source.hf_config,
            dtype="float32",
            block_size=self.block_size,
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
            family.load_weights(
                family.build(config, torch.device("cpu")), [*weights, ("no.such.tensor", torch.zeros(1))]
            )

    def test_generates_through_the_engine(self, model_source):
        from weft.entrypoints.llm import LLM
        from weft.sampling_params import SamplingParams

        llm = LLM(
            model=model_source, engine={"block_size": self.block_size, "num_kv_blocks": 256, "max_model_len": 256}
        )
        outputs = llm.generate([[5, 6, 7], [8] * 40], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [len(output.outputs[0].token_ids) for output in outputs] == [4, 4]
