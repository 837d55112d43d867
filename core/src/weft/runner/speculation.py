"""Speculative decoding on the runner's side (:mod:`weft.contracts.speculator`): proposing and verifying.

After a step, the speculator hears what each request gained (:class:`~weft.contracts.speculator.Verified`) and
proposes up to ``num_speculative_tokens`` tokens for its next step (:meth:`Speculation.propose`); they go back to
the engine core with the step's output, which schedules them as ``SchedulerOutput.spec_token_ids``. That step
feeds them after the request's last token, and :meth:`Speculation.verify` keeps the longest run the target
accepts (:class:`~weft.runner.rejection_sampler.RejectionSampler`), reading the distributions a sampling
speculator drew them from. :class:`~weft.runner.model_runner.ModelRunner` owns one and keeps the requests' states.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from weft.contracts.executor import NewRequest
from weft.contracts.speculator import DraftInputs, ProposalStep, SpeculationRequest, Speculator, Verified
from weft.runner.penalties import TokenCounts
from weft.runner.rejection_sampler import RejectionSampler, VerifiedBatch
from weft.runner.request_state import RequestState
from weft.runner.sampler import Sampler


@contextmanager
def feeding_proposals(states: list[RequestState], proposals: dict[int, list[int]]) -> Iterator[None]:
    """A speculating row feeds its proposals (``proposals``, by batch row) after its last token: they stand in its
    token ids while the step's forward runs."""
    for row, proposed in proposals.items():
        states[row].token_ids.extend(proposed)
    try:
        yield
    finally:
        for row, proposed in proposals.items():
            del states[row].token_ids[-len(proposed) :]


class Speculation:
    """The runner's speculator (None: speculative decoding is off) and the verification of its proposals."""

    def __init__(self, speculator: Speculator | None, sampler: Sampler, draft_groups: range) -> None:
        """``draft_groups``: the indices of the speculator's own KV-cache groups (empty: it owns no model)."""
        self.speculator = speculator
        """Proposes each request's next tokens after its step (None: speculative decoding is off)."""
        self.rejection_sampler = RejectionSampler(sampler)
        """Verifies the steps that carry proposals (``SchedulerOutput.spec_token_ids``)."""
        self.draft_groups = draft_groups
        self._draft_probs: dict[str, torch.Tensor] = {}
        """The distributions of a sampling speculator's proposals, by request, until its step verifies them."""

    def add_request(self, new: NewRequest) -> None:
        """Have the speculator follow a request the runner took in (again, when resumed after a preemption)."""
        if self.speculator is not None:
            self.speculator.remove_request(new.request_id)  # resumed after a preemption: followed again from its tokens
            self.speculator.add_request(
                SpeculationRequest(
                    new.request_id, new.token_ids[: new.num_prompt_tokens], new.token_ids[new.num_prompt_tokens :]
                )
            )

    def remove_request(self, request_id: str) -> None:
        """Forget a finished request (its proposals' distributions included)."""
        self._draft_probs.pop(request_id, None)
        if self.speculator is not None:
            self.speculator.remove_request(request_id)

    def verify(
        self, logits: torch.Tensor, states: list[RequestState], proposed: list[list[int]], token_counts: TokenCounts
    ) -> VerifiedBatch:
        """Verify each of ``states``' ``proposed`` tokens against ``logits`` (a row per proposal, then the row's last
        position's; ``states``' computed counts already past the step)."""
        # The position of the token each row's first logits draw (its seeded draws follow from it).
        first_positions = [
            state.num_computed_tokens - len(row_proposals)
            for state, row_proposals in zip(states, proposed, strict=True)
        ]
        return self.rejection_sampler.verify(
            logits, states, proposed, first_positions, self._take_draft_probs(states, proposed, logits), token_counts
        )

    def propose(self, verified: list[Verified], requests: dict[str, RequestState]) -> dict[str, list[int]]:
        """Tell the speculator what the step's requests gained, and take its proposals for their next step
        (none when speculative decoding is off)."""
        speculator = self.speculator
        if speculator is None or not verified:
            return {}
        speculator.on_verified(verified)
        k = speculator.config.num_speculative_tokens
        ids, limits = [], []
        for result in verified:
            state = requests[result.request_id]
            # The next step feeds its proposals after its newest token: none at or past max_model_len (a draft would
            # compute positions the model has no rotary angle for, and the scheduler would cut them anyway).
            left = min(k, speculator.config.max_model_len - len(state.token_ids))
            if state.params.max_tokens is not None:
                left = min(left, state.params.max_tokens - len(state.token_ids) + state.num_prompt_tokens - 1)
            ids.append(result.request_id)
            limits.append(max(left, 0))
        if not ids:
            return {}
        draft_inputs = None
        if self.draft_groups:
            draft_inputs = DraftInputs(
                [[requests[request_id].block_ids[group] for group in self.draft_groups] for request_id in ids]
            )
        made = speculator.propose(ProposalStep(ids, limits, draft_inputs))
        if made.probs is not None:  # drawn proposals: the verification needs each one's distribution
            start = 0
            for request_id, proposed, limit in zip(ids, made.token_ids, limits, strict=True):
                if proposed and limit:
                    self._draft_probs[request_id] = made.probs[start : start + min(len(proposed), limit)]
                start += len(proposed)
        return {
            request_id: proposed[:limit]
            for request_id, proposed, limit in zip(ids, made.token_ids, limits, strict=True)
            if proposed and limit
        }

    def _take_draft_probs(
        self, states: list[RequestState], proposed: list[list[int]], logits: torch.Tensor
    ) -> torch.Tensor | None:
        """The distributions the rows' proposals were drawn from, request-major (one-hot rows for deterministic
        proposals beside drawn ones); None when every row's proposals are deterministic."""
        stored = [self._draft_probs.pop(state.request_id, None) for state in states]
        if all(probs is None for probs in stored):
            return None
        parts = []
        for probs, tokens in zip(stored, proposed, strict=True):
            if not tokens:
                continue
            if probs is None:
                ids = torch.tensor(tokens, device=logits.device)
                probs = torch.nn.functional.one_hot(ids, logits.shape[-1]).float()
            parts.append(probs[: len(tokens)].to(logits.device, torch.float32))
        return torch.cat(parts)
