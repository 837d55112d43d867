"""Tokenizers: the conformance kit on "hf" and "gguf", chat templates against HF, {% generation %} blocks."""

from __future__ import annotations

import pytest

from conftest import smollm2_gguf
from weft.builtins.chat_template import ChatTemplate
from weft.contracts.loader import ModelSource
from weft.testing import TokenizerContract


class TestHFTokenizer(TokenizerContract):
    plugin_name = "hf"

    @pytest.fixture
    def tokenizer(self, plugin, tokenizer_files):
        source = ModelSource(path=str(tokenizer_files), format="safetensors", hf_config={}, tokenizer="hf", name="t")
        return plugin.from_source(source)


@pytest.fixture(scope="module")
def smollm2_source():
    from weft_gguf.loader import GGUFLoader

    return GGUFLoader().resolve("smollm2-135m-instruct")


class TestGGUFTokenizer(TokenizerContract):
    plugin_name = "gguf"

    @pytest.fixture
    def tokenizer(self, plugin, smollm2_source):
        return plugin.from_source(smollm2_source)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "图片🌍 ok?"},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_renders_like_hf(hf_tokenizer, smollm2_source, conversation, add_generation_prompt):
    from weft_gguf.tokenizer import GGUFTokenizer

    ours = GGUFTokenizer.from_source(smollm2_source)
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt) == expected
    assert ours.encode(expected, add_special_tokens=False) == hf_tokenizer.encode(expected, add_special_tokens=False)


GENERATION_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|end|>{% endif %}\n{% endfor %}"
)


def test_generation_blocks_render_and_report_spans():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    template = ChatTemplate(GENERATION_TEMPLATE)
    text, spans = template.render_with_generation_spans(messages)
    assert text == "<|user|>\nHi<|end|><|assistant|>\nHello there<|end|>"  # trim_blocks, as HF renders
    assert [text[a:b] for a, b in spans] == ["Hello there<|end|>"]
    assert template.render(messages) == text


def test_generation_blocks_keep_whitespace_control_and_literals():
    template = ChatTemplate(
        "A {%- generation -%}   B {{ '{% generation %}' }}   {%- endgeneration %} C{# {% generation %} #}"
        "{% raw %}{% endgeneration %}{% endraw %}"
    )
    text, spans = template.render_with_generation_spans([])
    assert text == "AB {% generation %} C{% endgeneration %}"
    assert [text[a:b] for a, b in spans] == ["B {% generation %}"]


def test_variables_set_inside_a_generation_block_stay_local():
    template = ChatTemplate(
        "{% set x = 'outer' %}{% generation %}{% set x = 'inner' %}{{ x }}{% endgeneration %}/{{ x }}"
    )
    assert template.render([]) == "inner/outer"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{% generation %}unclosed", "endgeneration"),
        ("stray {% endgeneration %}", "endgeneration"),
        ("{% generation %}a{% endfor %}", "endfor"),
        ("{% generation foo %}a{% endgeneration %}", "foo"),
    ],
)
def test_malformed_generation_tags_are_syntax_errors(source, message):
    from jinja2 import TemplateSyntaxError

    with pytest.raises(TemplateSyntaxError, match=message):
        ChatTemplate(source)


def test_templates_run_sandboxed():
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ValueError, match="chat template: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
