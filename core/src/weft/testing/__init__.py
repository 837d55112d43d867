"""The conformance kit: each slot's contract as a pytest test suite.

A plugin author subclasses the suite of their slot in a test module, names
their plugin, and runs pytest::

    from weft.testing import TokenizerContract

    class TestMyTokenizer(TokenizerContract):
        plugin_name = "bytes"

        @pytest.fixture
        def tokenizer(self, plugin):
            return plugin.from_source(my_source)

The suites load the plugin the way the engine does (through its entry point,
with the compatibility checks), so they also catch packaging mistakes. The
kit is registered as a pytest plugin (``pytest11``) and adds the
``weft_registry`` fixture.
"""

from weft.testing.connector_suite import KVConnectorContract
from weft.testing.mm_processor_suite import MMProcessorContract
from weft.testing.output_suites import ReasoningParserContract, StructuredOutputContract, ToolParserContract
from weft.testing.quantization_suite import QuantizationContract
from weft.testing.speculator_suite import SpeculatorContract
from weft.testing.suites import (
    AttentionContract,
    HooksContract,
    LoaderContract,
    ModelContract,
    OpContract,
    PlatformContract,
    TokenizerContract,
)

__all__ = [
    "AttentionContract",
    "HooksContract",
    "KVConnectorContract",
    "LoaderContract",
    "MMProcessorContract",
    "ModelContract",
    "OpContract",
    "PlatformContract",
    "QuantizationContract",
    "ReasoningParserContract",
    "SpeculatorContract",
    "StructuredOutputContract",
    "TokenizerContract",
    "ToolParserContract",
]
