"""Contract suites of the slots that shape a reply: structured-output backends, tool parsers, reasoning parsers."""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import pytest

from weft.testing.suites import _Contract


class StructuredOutputContract(_Contract):
    """The structured-output contract (:mod:`weft.contracts.structured_output`). Provide a ``tokenizer``
    fixture (the backend is built over its ``vocabulary_bytes()``)."""

    slot = "structured_output"
    document: ClassVar[dict[str, Any]] = {"name": "Ada", "tags": ["x", "y"], "age": 36}
    schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}},
            "age": {"type": "integer"},
        },
        "required": ["name", "tags", "age"],
    }

    @pytest.fixture
    def tokenizer(self, plugin):
        raise NotImplementedError("define a `tokenizer` fixture: the vocabulary the backend is built for")

    @pytest.fixture
    def backend(self, plugin, tokenizer):
        from weft.contracts.structured_output import Vocabulary

        vocabulary = Vocabulary(
            tokenizer.vocabulary_bytes(), tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids))
        )
        return plugin(None, vocabulary)

    def test_validation_refuses_what_cannot_compile_naming_the_field(self, plugin):
        from weft.contracts.structured_output import StructuredOutputsParams

        for field, constraint in (
            ("json", StructuredOutputsParams(json={"type": "no-such-type"})),
            ("regex", StructuredOutputsParams(regex="(unclosed")),
            ("grammar", StructuredOutputsParams(grammar="root ::= (")),
        ):
            with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):
                plugin.validate(constraint)
        plugin.validate(StructuredOutputsParams(json=self.schema))

    def test_a_valid_document_is_allowed_token_by_token_then_the_end(self, backend, tokenizer):
        from weft.contracts.structured_output import StructuredOutputsParams

        matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=self.schema, any_whitespace=False)))
        tokens = tokenizer.encode(json.dumps(self.document, separators=(",", ":")), add_special_tokens=False)
        for token in [*tokens, min(tokenizer.eos_token_ids)]:
            assert _allowed(backend, matcher, token), f"token {token} of a valid document is masked off"
            assert matcher.accept_token(token)
        assert matcher.is_terminated()

    def test_a_forbidden_token_is_masked_and_refused_without_moving(self, backend, tokenizer):
        from weft.contracts.structured_output import StructuredOutputsParams

        matcher = backend.matcher(backend.compile(StructuredOutputsParams(choice=("yes", "no"))))
        (wrong,) = tokenizer.encode("z", add_special_tokens=False)[:1]
        assert not _allowed(backend, matcher, wrong)
        assert not matcher.accept_token(wrong)
        for token in tokenizer.encode("yes", add_special_tokens=False):
            assert matcher.accept_token(token)

    def test_rollback_restores_the_mask(self, backend, tokenizer):
        import torch

        from weft.contracts.structured_output import StructuredOutputsParams, bitmask_words

        matcher = backend.matcher(backend.compile(StructuredOutputsParams(json=self.schema)))
        tokens = tokenizer.encode('{"name": "Ada", "tags": [', add_special_tokens=False)
        for token in tokens[:2]:
            assert matcher.accept_token(token)
        before = torch.zeros(1, bitmask_words(backend.vocabulary.size), dtype=torch.int32)
        matcher.fill_bitmask(before, 0)
        for token in tokens[2:]:
            assert matcher.accept_token(token)
        matcher.rollback(len(tokens) - 2)
        after = torch.zeros_like(before)
        matcher.fill_bitmask(after, 0)
        assert torch.equal(before, after)

    def test_batched_fill_equals_row_by_row(self, backend, tokenizer):
        import torch

        from weft.contracts.structured_output import StructuredOutputsParams, bitmask_words

        compiled = backend.compile(StructuredOutputsParams(json=self.schema))
        text = json.dumps(self.document)
        matchers = []
        for count in range(24):
            matcher = backend.matcher(compiled)
            for token in tokenizer.encode(text, add_special_tokens=False)[: count % 10]:
                assert matcher.accept_token(token)
            matchers.append(matcher)
        batched = torch.zeros(len(matchers), bitmask_words(backend.vocabulary.size), dtype=torch.int32)
        backend.fill_bitmasks(matchers, batched)
        rows = torch.zeros_like(batched)
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(rows, row)
        assert torch.equal(batched, rows)


def _allowed(backend: Any, matcher: Any, token: int) -> bool:
    import torch

    from weft.contracts.structured_output import bitmask_words

    mask = torch.zeros(1, bitmask_words(backend.vocabulary.size), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


class ToolParserContract(_Contract):
    """The tool-parser contract (:mod:`weft.contracts.tool_parser`): the calls it renders parse back, whole
    and streamed in any pieces, and nothing it is fed raises."""

    slot = "tool_parser"
    calls: ClassVar[list[dict[str, Any]]] = [
        {"name": "get_weather", "arguments": {"city": 'Paris "Rive Gauche"', "days": 3, "hours": [8, 12]}},
        {"name": "now", "arguments": {}},
    ]
    leading_text: ClassVar[str] = "Let me check.\n"
    """Text before the calls (empty for a format where an answer is either calls or text)."""

    def test_rendered_calls_parse_back_whole_and_streamed(self, plugin):
        text = self.leading_text + plugin().render_calls(self.calls)
        expected = [(call["name"], call["arguments"]) for call in self.calls]
        parsed = plugin().parse(text)
        assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == expected
        for seed in range(6):
            content, streamed = stream_tool_calls(plugin(), text, seed)
            assert content == (parsed.content or "")
            assert [(name, json.loads(arguments)) for name, arguments in streamed] == expected

    def test_unfinished_and_garbage_output_never_raises_and_streams_as_parsed(self, plugin):
        text = self.leading_text + plugin().render_calls(self.calls)
        for cut in range(0, len(text), max(1, len(text) // 25)):
            parsed = plugin().parse(text[:cut])
            # A grammar-held parser (streams_pieces) returns a call cut short as written, as its stream sent it.
            whole = parsed.calls[:-1] if plugin.streams_pieces else parsed.calls
            assert all(isinstance(json.loads(call.arguments), dict) for call in whole)
            assert stream_tool_calls(plugin(), text[:cut], cut) == parsed_tool_calls(parsed)
        for garbage in ("{{{", "<tool_call>]]", "\x00\ufffd", '{"name": 1}'):
            assert stream_tool_calls(plugin(), garbage, 0) == parsed_tool_calls(plugin().parse(garbage))


def parsed_tool_calls(parsed: Any) -> tuple[str, list[tuple[str, str]]]:
    """A whole-output parse as :func:`stream_tool_calls` reports a stream: the content and each call's
    ``(name, arguments)``."""
    return parsed.content or "", [(call.name, call.arguments) for call in parsed.calls]


def stream_tool_calls(parser: Any, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` to ``parser`` in random pieces (``seed``): the content and the ``(name, arguments)`` of
    each call its deltas add up to, checking that a call's first piece alone carries its id and name."""
    rng, position, content, calls = random.Random(seed), 0, "", {}
    deltas = []
    while position < len(text):
        size = rng.randint(1, 6)
        deltas.append(parser.push(text[position : position + size]))
        position += size
    deltas.append(parser.finish())
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            if piece.index not in calls:
                assert piece.id and piece.name, "a call's first piece carries its id and name"
                calls[piece.index] = [piece.name, ""]
            else:
                assert piece.id is None and piece.name is None, "only a call's first piece carries its id and name"
            calls[piece.index][1] += piece.arguments
    return content, [(name, arguments) for name, arguments in calls.values()]


class ReasoningParserContract(_Contract):
    """The reasoning-parser contract (:mod:`weft.contracts.reasoning_parser`). Set ``thinking_prompt`` (a
    prompt that leaves the model thinking) and ``thinking_output`` with the ``reasoning`` and ``answer``
    it splits into."""

    slot = "reasoning_parser"
    thinking_prompt: ClassVar[str]
    thinking_output: ClassVar[str]
    reasoning: ClassVar[str]
    answer: ClassVar[str]

    def test_splits_whole_and_streamed_alike(self, plugin):
        parser = plugin(None, self.thinking_prompt)
        assert parser.reasoning_expected()
        assert parser.parse(self.thinking_output) == (self.reasoning or None, self.answer or None)
        for seed in range(6):
            fresh, rng, position, pieces = plugin(None, self.thinking_prompt), random.Random(seed), 0, []
            while position < len(self.thinking_output):
                size = rng.randint(1, 5)
                pieces.append(fresh.push(self.thinking_output[position : position + size]))
                position += size
            pieces.append(fresh.finish())
            assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == (self.reasoning, self.answer)

    def test_unfinished_and_garbage_output_never_raises(self, plugin):
        for cut in range(len(self.thinking_output)):
            reasoning, answer = plugin(None, self.thinking_prompt).parse(self.thinking_output[:cut])
            assert all(part is None or isinstance(part, str) for part in (reasoning, answer))
        for garbage in ("</think><think>", "\x00", ""):
            plugin(None, self.thinking_prompt).parse(garbage)
