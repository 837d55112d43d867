"""The speculator contract's suite (:mod:`weft.contracts.speculator`): any speculator, driven as the runner
drives it."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from weft.testing.suites import _Contract


def repetitive_context(seed: int, vocab: int, length: int) -> list[int]:
    """Random tokens with spans copied from earlier in the sequence: text a speculator can guess from."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(8)]
    while len(tokens) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens.extend(tokens[start : start + rng.randint(2, 12)])
        else:
            tokens.append(rng.randrange(vocab))
    return tokens[:length]


class SpeculatorContract(_Contract):
    """The speculator contract. The speculator is built with :meth:`config`; a model-owning speculator
    overrides :meth:`proposal_step` to give each step its :class:`~weft.contracts.speculator.DraftInputs`."""

    slot = "speculator"
    num_speculative_tokens: ClassVar[int] = 4
    vocab_size: ClassVar[int] = 50
    max_model_len: ClassVar[int] = 4096
    options: ClassVar[Any] = None
    """The plugin's Options instance (None: its defaults)."""

    def config(self) -> Any:
        from weft.contracts.speculator import SpeculatorConfig

        return SpeculatorConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )

    def proposal_step(self, speculator: Any, request_ids: list[str], max_tokens: list[int]) -> Any:
        from weft.contracts.speculator import ProposalStep

        return ProposalStep(request_ids, max_tokens)

    @pytest.fixture
    def build(self, plugin):
        return lambda: plugin(self.options, self.config())

    def _propose(self, speculator: Any, request_ids: list[str], max_tokens: list[int]) -> list[list[int]]:
        proposals = speculator.propose(self.proposal_step(speculator, request_ids, max_tokens))
        assert len(proposals.token_ids) == len(request_ids), "one row of proposals per requested row"
        for row, (tokens, most) in enumerate(zip(proposals.token_ids, max_tokens, strict=False)):
            assert len(tokens) <= min(most, self.num_speculative_tokens), (
                f"row {row}: {len(tokens)} proposals, but at most {min(most, self.num_speculative_tokens)} were asked"
            )
            assert all(isinstance(token, int) and 0 <= token < self.vocab_size for token in tokens), (
                f"row {row}: proposals {tokens} are not token ids below the vocabulary size {self.vocab_size}"
            )
        total = sum(len(tokens) for tokens in proposals.token_ids)
        if proposals.probs is not None:
            import torch

            probs = proposals.probs.float().cpu()
            assert tuple(probs.shape) == (total, self.vocab_size), "probs: one row of the vocabulary per proposal"
            torch.testing.assert_close(probs.sum(-1), torch.ones(total), atol=1e-3, rtol=0)
            drawn = torch.tensor([token for tokens in proposals.token_ids for token in tokens], dtype=torch.long)
            assert bool((probs.gather(1, drawn.unsqueeze(1)) > 0).all()), "a proposal its own distribution excludes"
        return proposals.token_ids

    def test_is_a_speculator_named_as_registered(self, plugin):
        from weft.contracts.speculator import Speculator

        assert issubclass(plugin, Speculator)
        assert plugin.name == self.plugin_name, (
            f"{plugin.__name__}.name is {plugin.name!r} but its entry point is {self.plugin_name!r}"
        )

    def test_kv_cache_groups_are_specs_with_their_own_layer_names(self, build):
        from weft.contracts.kv_cache import KVCacheGroupSpec

        groups = build().kv_cache_groups()
        assert isinstance(groups, tuple) and all(isinstance(group, KVCacheGroupSpec) for group in groups)
        names = [name for group in groups for name in group.layer_names]
        assert len(names) == len(set(names)), "a layer belongs to one KV-cache group"

    def test_proposals_stay_within_what_was_asked_and_the_vocabulary(self, build):
        from weft.contracts.speculator import SpeculationRequest

        speculator = build()
        ids = [f"r{seed}" for seed in range(6)]
        for seed, request_id in enumerate(ids):
            context = repetitive_context(seed, self.vocab_size, 40 + 30 * seed)
            speculator.add_request(SpeculationRequest(request_id, context))
        k = self.num_speculative_tokens
        for max_tokens in ([k] * 6, [0, 1, k, 2, 0, k], [k + 3] * 6):
            self._propose(speculator, ids, max_tokens)
        self._propose(speculator, [], [])

    def test_the_same_context_gives_the_same_proposals_whatever_the_batch(self, build):
        from weft.contracts.speculator import SpeculationRequest

        first, second = build(), build()
        contexts = {f"r{seed}": repetitive_context(seed, self.vocab_size, 200) for seed in range(5)}
        for request_id, context in contexts.items():
            first.add_request(SpeculationRequest(request_id, context))
        for request_id, context in reversed(contexts.items()):
            second.add_request(SpeculationRequest(request_id, context[:50], context[50:]))
        ids = list(contexts)
        k = self.num_speculative_tokens
        together = self._propose(first, ids, [k] * len(ids))
        assert together == self._propose(first, ids, [k] * len(ids)), "proposing again changed the proposals"
        assert together[::-1] == self._propose(second, ids[::-1], [k] * len(ids))
        assert [self._propose(second, [request_id], [k])[0] for request_id in ids] == together

    def test_told_what_was_accepted_it_proposes_as_for_the_accepted_context(self, build):
        """Rejected proposals leave no trace: after each verified step, a speculator that followed the request
        proposes what a fresh one given the request's whole context proposes."""
        from weft.contracts.speculator import SpeculationRequest, Verified

        speculator, rng, k = build(), random.Random(7), self.num_speculative_tokens
        contexts = {f"r{seed}": repetitive_context(seed, self.vocab_size, 60) for seed in range(4)}
        truths = {
            request_id: repetitive_context(seed + 100, self.vocab_size, 400) for seed, request_id in enumerate(contexts)
        }
        for request_id, context in contexts.items():
            speculator.add_request(SpeculationRequest(request_id, context))
        ids = list(contexts)
        for _ in range(12):
            proposals = self._propose(speculator, ids, [k] * len(ids))
            results = []
            for request_id, proposed in zip(ids, proposals, strict=False):
                cut = rng.randint(0, len(proposed))  # the scheduler may verify only a prefix
                truth = truths[request_id]
                accepted = 0
                while accepted < cut and rng.random() < 0.7:
                    accepted += 1
                tokens = proposed[:accepted] + [truth[len(contexts[request_id]) % len(truth)]]
                contexts[request_id] = contexts[request_id] + tokens
                results.append(Verified(request_id, cut, accepted, tokens))
            speculator.on_verified(results)
            fresh = build()
            for request_id, context in contexts.items():
                fresh.add_request(SpeculationRequest(request_id, context))
            assert self._propose(speculator, ids, [k] * len(ids)) == self._propose(fresh, ids, [k] * len(ids))

    def test_removed_requests_are_forgotten(self, build):
        from weft.contracts.speculator import SpeculationRequest, Verified

        speculator, k = build(), self.num_speculative_tokens
        speculator.add_request(SpeculationRequest("a", repetitive_context(1, self.vocab_size, 120)))
        speculator.remove_request("a")
        speculator.remove_request("a")
        speculator.remove_request("never-added")
        speculator.on_verified([Verified("gone", 0, 0, [1])])  # a request removed while its step ran
        replacement = repetitive_context(2, self.vocab_size, 120)
        speculator.add_request(SpeculationRequest("a", replacement))
        fresh = build()
        fresh.add_request(SpeculationRequest("a", replacement))
        assert self._propose(speculator, ["a"], [k]) == self._propose(fresh, ["a"], [k])
