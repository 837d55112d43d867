"""The example plugin passes the conformance kit (and documents how an author uses it)."""

import pytest

from weft.testing import HooksContract, TokenizerContract


class TestByteTokenizer(TokenizerContract):
    plugin_name = "bytes"

    @pytest.fixture
    def tokenizer(self, plugin):
        return plugin.from_source(None)


class TestExampleHooks(HooksContract):
    plugin_name = "example-stats"
