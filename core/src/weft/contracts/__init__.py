"""The stable plugin API of Weft: one module per slot.

A plugin implements one of the contracts below and registers it under the
slot's entry-point group; the entry-point *name* is what ``weft.toml`` selects.

=================  ==========================  ==================================================
slot               entry-point group           contract
=================  ==========================  ==================================================
platform           ``weft.platform``           :class:`weft.contracts.platform.Platform`
attention          ``weft.attention``          :class:`weft.contracts.attention.AttentionBackend`
model              ``weft.model``              :class:`weft.contracts.model.ModelFamily`
loader             ``weft.loader``             :class:`weft.contracts.loader.WeightLoader`
tokenizer          ``weft.tokenizer``          :class:`weft.contracts.tokenizer.Tokenizer`
kv_connector       ``weft.kv_connector``       :class:`weft.contracts.kv_connector.KVConnector`
ops                ``weft.ops``                :class:`weft.contracts.ops.OpImplementation`
executor           ``weft.executor``           :class:`weft.contracts.executor.Executor`
structured_output  ``weft.structured_output``  :class:`weft.contracts.structured_output.StructuredOutputBackend`
tool_parser        ``weft.tool_parser``        :class:`weft.contracts.tool_parser.ToolParser`
reasoning_parser   ``weft.reasoning_parser``   :class:`weft.contracts.reasoning_parser.ReasoningParser`
speculator         ``weft.speculator``         :class:`weft.contracts.speculator.Speculator`
mm_processor       ``weft.mm_processor``       :class:`weft.contracts.mm_processor.MMProcessor`
encoder_connector  ``weft.encoder_connector``  :class:`weft.contracts.encoder_connector.EncoderConnector`
quantization       ``weft.quantization``       :class:`weft.contracts.quantization.QuantizationMethod`
hooks              ``weft.hooks``              a module or object with ``@hookimpl`` functions
                                               (:mod:`weft.contracts.hooks`)
=================  ==========================  ==================================================

Model families register one entry point per Hugging Face architecture they
build (``LlamaForCausalLM = mypkg.llama:LlamaFamily``); op implementations are
named ``<op>.<implementation>`` (``rms_norm.triton``).

Compatibility: a plugin distribution declares the core API range it supports
through its requirement on ``weft-core`` (``weft-core>=1.0,<2``). Core compares
that range with :data:`CORE_API` from the distribution's metadata, before it
imports anything of the plugin, and refuses a plugin whose range excludes it.
``CORE_API`` is weft-core's ``major.minor``: a minor release only adds to the
contracts, a major release may break them. The same version covers :mod:`weft.api`,
the rest of what a plugin may import of core (the implementations it may build on).
"""

from weft._version import __version__

CORE_API: tuple[int, int] = tuple(int(part) for part in __version__.split(".")[:2])  # type: ignore[assignment]
"""The plugin API version of this core, ``(major, minor)``."""

SLOT_GROUPS: dict[str, str] = {
    "platform": "weft.platform",
    "attention": "weft.attention",
    "model": "weft.model",
    "loader": "weft.loader",
    "tokenizer": "weft.tokenizer",
    "kv_connector": "weft.kv_connector",
    "ops": "weft.ops",
    "executor": "weft.executor",
    "structured_output": "weft.structured_output",
    "tool_parser": "weft.tool_parser",
    "reasoning_parser": "weft.reasoning_parser",
    "speculator": "weft.speculator",
    "mm_processor": "weft.mm_processor",
    "encoder_connector": "weft.encoder_connector",
    "quantization": "weft.quantization",
    "hooks": "weft.hooks",
}
"""Each slot and the entry-point group its plugins register under."""

__all__ = ["CORE_API", "SLOT_GROUPS"]
