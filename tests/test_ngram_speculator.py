"""The ``ngram`` speculator: prompt lookup on crafted sequences against a plain per-n reference, its options,
and the speculator kit."""

from __future__ import annotations

import random

import numpy
import pytest

from weft.builtins.ngram_speculator import NgramOptions, NgramSpeculator, prompt_lookup
from weft.contracts.speculator import ProposalStep, SpeculationRequest, SpeculatorConfig, Verified
from weft.testing import SpeculatorContract


class TestNgramContract(SpeculatorContract):
    plugin_name = "ngram"


class TestNgramContractShortLookups(SpeculatorContract):
    plugin_name = "ngram"
    options = NgramOptions(prompt_lookup_min=1, prompt_lookup_max=3)
    num_speculative_tokens = 2


def reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule spelled out: for n from max_n down to min_n, the first earlier window equal to the last n
    tokens (a window that ends before the last token); the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return prompt_lookup(numpy.array(tokens, dtype=numpy.int64), min_n, max_n, k).tolist()


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # vLLM's docstring example: [4, 2, 3] misses, [2, 3] follows 1
        ([1, 2, 3, 4, 2, 3], 3, 3, 4, []),  # no earlier [4, 2, 3]
        ([5, 6, 7, 9, 6, 7, 8, 6, 7], 2, 2, 3, [9, 6, 7]),  # the earliest of two matches of [6, 7]
        ([5, 6, 7, 9, 1, 6, 7, 8, 5, 6, 7], 2, 3, 2, [9, 1]),  # [5, 6, 7] beats [6, 7]
        ([4, 4, 4, 4], 1, 2, 5, [4, 4]),  # overlapping: the earliest [4, 4] ends at index 1
        ([3], 1, 1, 2, []),  # nothing earlier
        ([1, 2, 1, 2], 1, 5, 0, []),  # k = 0
        ([9, 8, 7, 1, 2, 3], 1, 4, 3, []),  # the last token never occurred before
    ],
)
def test_crafted_sequences(tokens, min_n, max_n, k, expected):
    assert lookup(tokens, min_n, max_n, k) == expected
    assert reference_lookup(tokens, min_n, max_n, k) == expected


def test_random_sequences_match_the_reference():
    rng = random.Random(0)
    for _ in range(400):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(0, 6)
        assert lookup(tokens, min_n, max_n, k) == reference_lookup(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_a_long_context_finds_the_copied_passage():
    rng = numpy.random.default_rng(0)
    passage = rng.integers(0, 30000, 300).tolist()
    filler = rng.integers(0, 30000, 40000).tolist()
    context = filler + passage + filler[:500] + passage[:120]
    assert lookup(context, 2, 5, 4) == passage[120:124]


def config(k: int = 4, max_model_len: int = 1000) -> SpeculatorConfig:
    return SpeculatorConfig(num_speculative_tokens=k, vocab_size=100, max_model_len=max_model_len)


def test_options_default_and_fill_each_other_as_vllm_does():
    assert (NgramSpeculator(None, config()).min_n, NgramSpeculator(None, config()).max_n) == (5, 5)
    only_max = NgramSpeculator(NgramOptions(prompt_lookup_max=3), config())
    assert (only_max.min_n, only_max.max_n) == (3, 3)
    only_min = NgramSpeculator(NgramOptions(prompt_lookup_min=2), config())
    assert (only_min.min_n, only_min.max_n) == (2, 2)
    with pytest.raises(ValueError, match="prompt_lookup_max = 2 is below prompt_lookup_min = 3"):
        NgramSpeculator(NgramOptions(prompt_lookup_min=3, prompt_lookup_max=2), config())
    with pytest.raises(ValueError, match="prompt_lookup_min = 0"):
        NgramSpeculator(NgramOptions(prompt_lookup_min=0), config())


def test_proposals_follow_the_output_and_stop_at_the_context_length():
    speculator = NgramSpeculator(NgramOptions(prompt_lookup_min=2, prompt_lookup_max=3), config(k=4, max_model_len=12))
    speculator.add_request(SpeculationRequest("a", [1, 2, 3, 4, 5, 6, 7]))
    assert speculator.propose(ProposalStep(["a"], [4])).token_ids == [[]]
    speculator.on_verified([Verified("a", 0, 0, [1, 2])])  # the output repeats the prompt's start
    # 9 tokens of 12: room for 3, and the step asked for at most 2.
    assert speculator.propose(ProposalStep(["a"], [4])).token_ids == [[3, 4, 5]]
    assert speculator.propose(ProposalStep(["a"], [2])).token_ids == [[3, 4]]
    with pytest.raises(KeyError, match="request 'b' was never added"):
        speculator.propose(ProposalStep(["b"], [4]))
