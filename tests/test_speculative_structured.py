"""Speculative decoding under structured outputs: constrained requests verify proposals, each position masked by
the grammar advanced over the proposals before it; the proposals the step rejects are rolled back.

The masks at each position against a matcher walked to that position by hand (xgrammar's own fill), in the fill
thread's functions and in fill processes; then the engine: greedy output identical with speculation off, with
``ngram`` and with a self-draft, in a batch mixing JSON-schema, regex and choice constraints with free rows, stop
strings and n=2; rejected proposals rolled back, the output still valid JSON.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("weft_xgrammar")

from weft.contracts.structured_output import StructuredOutputsParams, Vocabulary, bitmask_words  # noqa: E402
from weft.engine.core.grammar_proposals import fill_positions, settle  # noqa: E402
from weft_xgrammar.backend import XgrammarBackend, XgrammarMatcher  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
}
DOCUMENT = '{"name":"bob","ok":true,"n":42}'


@pytest.fixture(scope="module")
def tokenizer():
    from weft.config import load_config
    from weft.plugins import PluginRegistry
    from weft.resolve import load_tokenizer, resolve_source

    registry, config = PluginRegistry(), load_config(None, {})
    _, source = resolve_source(registry, config)
    return load_tokenizer(registry, config, source)


@pytest.fixture(scope="module")
def backend(tokenizer):
    vocabulary = Vocabulary(tokenizer.vocabulary_bytes(), tokenizer.vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    return XgrammarBackend(None, vocabulary)


@pytest.fixture(scope="module")
def compiled(backend):
    return backend.compile(StructuredOutputsParams(json=SCHEMA, any_whitespace=False))


def walked(backend, compiled, tokens):
    """A fresh matcher that accepted ``tokens`` one by one: the reference for a position's mask."""
    matcher = backend.matcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    return matcher


def mask_after(backend, compiled, tokens, words):
    row = torch.zeros(1, words, dtype=torch.int32)
    walked(backend, compiled, tokens).fill_bitmask(row, 0)
    return row[0]


def refused_after(backend, compiled, tokens):
    """A token the grammar refuses after ``tokens``."""
    matcher = walked(backend, compiled, tokens)
    for token in range(3, 2000):
        if not matcher.accept_token(token):
            return token
        matcher.rollback(1)
    raise AssertionError(f"the grammar takes every token after {tokens}")


class CountingMatcher(XgrammarMatcher):
    """Counts the tokens rolled back."""

    def __init__(self, matcher):
        super().__init__(matcher.matcher)
        self.rolled_back = []

    def rollback(self, num_tokens):
        self.rolled_back.append(num_tokens)
        super().rollback(num_tokens)


def test_each_position_is_masked_as_after_the_proposals_before_it(backend, compiled, tokenizer):
    """Three matchers in one fill: one verifying proposals the grammar takes, one whose third proposal the grammar
    refuses (its rows from there allow everything: nothing past a refused proposal is kept; its refused proposal is
    masked off at its own position), one without proposals; rows request after request."""
    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    words = bitmask_words(backend.vocabulary.size)
    start = text[:2]
    refused = refused_after(backend, compiled, text[:4])
    cases = [text[2:6], [text[2], text[3], refused, text[5]], []]
    matchers = [walked(backend, compiled, start) for _ in cases]
    bitmask = torch.zeros(sum(len(proposed) + 1 for proposed in cases), words, dtype=torch.int32)
    took = fill_positions(backend, matchers, cases, bitmask)
    assert took == [text[2:6], text[2:4], []]
    expected = [mask_after(backend, compiled, start + text[2 : 2 + j], words) for j in range(5)]
    assert torch.equal(bitmask[0:5], torch.stack(expected))
    assert torch.equal(bitmask[5:8], torch.stack(expected[:3]))
    assert not bitmask[7, refused // 32] >> (refused % 32) & 1  # the refused proposal is masked at its position
    assert torch.equal(bitmask[8:10], torch.full((2, words), -1, dtype=torch.int32))
    assert torch.equal(bitmask[10], expected[0])
    # The matchers stand after the proposals they took.
    row = torch.zeros(1, words, dtype=torch.int32)
    matchers[0].fill_bitmask(row, 0)
    assert torch.equal(row[0], mask_after(backend, compiled, start + text[2:6], words))


def test_settling_keeps_the_accepted_proposals_and_rolls_back_the_rest(backend, compiled, tokenizer):
    """A step that accepted two of four proposals and replaced the third: the matcher keeps two, rolls back two and
    takes the replacement as usual; one whose tokens never came (preempted) rolls all back when it fills again; one
    that ended on an accepted proposal (the end token) is reported with the index of that token."""
    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    eos = min(backend.vocabulary.eos_token_ids)
    words = bitmask_words(backend.vocabulary.size)
    matchers = {
        "partial": CountingMatcher(walked(backend, compiled, text[:2])),
        "preempted": CountingMatcher(walked(backend, compiled, text[:2])),
        "ended": CountingMatcher(walked(backend, compiled, text[:-2])),
    }
    proposals = {"partial": text[2:6], "preempted": text[2:5], "ended": [text[-2], text[-1], eos]}
    bitmask = torch.zeros(sum(len(tokens) + 1 for tokens in proposals.values()), words, dtype=torch.int32)
    advanced = dict(zip(proposals, fill_positions(backend, list(matchers.values()), list(proposals.values()), bitmask)))
    assert advanced == proposals
    replacement = next(
        token for token in range(3, 2000) if token != text[4] and walked(backend, compiled, text[:4]).accept_token(token)
    )
    accepted = [
        ("ended", text[-2]),
        ("partial", text[2]),
        ("ended", text[-1]),
        ("partial", text[3]),
        ("partial", replacement),
        ("ended", eos),
    ]
    keep, ended = settle(advanced, accepted, ["preempted"], matchers.__getitem__)
    assert keep == [4] and ended == [(5, "ended")] and not advanced
    assert matchers["partial"].rolled_back == [2] and matchers["preempted"].rolled_back == [3]
    assert matchers["ended"].rolled_back == [] and matchers["ended"].is_terminated()
    assert matchers["partial"].accept_token(replacement)
    for name, tokens in (("partial", [*text[:4], replacement]), ("preempted", text[:2])):
        row = torch.zeros(1, words, dtype=torch.int32)
        matchers[name].fill_bitmask(row, 0)
        assert torch.equal(row[0], mask_after(backend, compiled, tokens, words)), name


@pytest.mark.parametrize("processes", [1, 2])
def test_fill_processes_mask_each_position_and_settle_by_the_steps_tokens(backend, compiled, tokenizer, processes):
    """The same in fill processes: handles verifying proposals fill a row per position, child after child; the next
    step's tokens keep the accepted proposals and roll back the rest (the masks after it are those of the tokens the
    requests really generated)."""
    from weft.engine.core.grammar_group import FillGroup

    text = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    words = bitmask_words(backend.vocabulary.size)
    refused = refused_after(backend, compiled, text[:3])
    group = FillGroup(XgrammarBackend, backend.options, backend.vocabulary, words, processes=processes, spin=0.001)
    try:
        handles = [group.new_handle() for _ in range(3)]
        payload = backend.serialize_compiled(compiled)
        proposals = [text[2:5], [], [text[2], refused, text[4]]]
        accepted = [(handle, token) for token in text[:2] for handle in handles]
        reply = group.step([(handle, 0, payload) for handle in handles], accepted, handles, proposals)
        assert sorted(reply.filled) == handles and not reply.ended and not reply.refused
        expected = {
            handles[0]: [mask_after(backend, compiled, text[: 2 + j], words) for j in range(4)],
            handles[1]: [mask_after(backend, compiled, text[:2], words)],
            handles[2]: [mask_after(backend, compiled, text[: 2 + j], words) for j in range(2)]
            + [torch.full((words,), -1, dtype=torch.int32)] * 2,
        }
        count = sum(len(expected[handle]) for handle in reply.filled)
        rows = torch.frombuffer(bytearray(group.rows(count)), dtype=torch.int32).view(-1, words)
        assert torch.equal(rows, torch.stack([row for handle in reply.filled for row in expected[handle]]))
        # Request 0 kept one proposal and drew another token; request 2 kept its one; request 1 decoded one token.
        replacement = next(
            token
            for token in range(3, 2000)
            if token != text[3] and walked(backend, compiled, text[:3]).accept_token(token)
        )
        generated = {handles[0]: [text[2], replacement], handles[1]: [text[2]], handles[2]: [text[2], text[3]]}
        accepted = [(handle, token) for handle in handles for token in generated[handle]]
        reply = group.step([], accepted, handles)
        assert sorted(reply.filled) == handles and not reply.refused
        rows = torch.frombuffer(bytearray(group.rows(3)), dtype=torch.int32).view(-1, words)
        for row, handle in zip(rows, reply.filled, strict=True):
            assert torch.equal(row, mask_after(backend, compiled, text[:2] + generated[handle], words)), handle
    finally:
        group.close()
