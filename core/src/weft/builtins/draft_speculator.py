"""The ``draft`` speculator: a smaller model of the same vocabulary proposes the next tokens greedily.

``[engine.speculative] model`` names the draft (a folder, a file or an alias, as ``model`` takes). It is loaded
through the engine (:class:`~weft.contracts.speculator.DraftModelLoader`: the target's loaders, quantization,
ops, attention backend and parallel layout), and its layers' KV cache is part of the engine's paged cache
(:meth:`DraftSpeculator.kv_cache_groups`, layer names prefixed ``draft.``): the engine sizes it, allocates each
request's blocks in it beside the target's, ``k`` slots ahead, and frees them with the request's.

Per request the speculator keeps the request's tokens and how many of them the draft's cache holds. To propose,
it first feeds the tokens its cache lacks (the whole prompt the first time, then the tokens the last step
accepted and the target's own one) in one forward, whose last position gives the first proposal; then one
token per forward for the rest, each proposal fed back. Proposals are the draft's argmax: deterministic, so the
rejection sampler takes them as one-hot draws and stays exact. The KV the proposals left in the draft's cache
is not trusted afterwards: the next catch-up starts after the target's newest token and writes over it. A
request's draft KV is computed from its first token on each time it is (re)added, never taken from a prefix
hit: the draft's blocks of a cached prefix may have been freed before the draft wrote them.

All of a step's proposal forwards run on the device; the proposals cross to the host once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.speculator import (
    DraftModelLoader,
    Proposals,
    ProposalStep,
    SpeculationRequest,
    Speculator,
    Verified,
)
from weft.runner.batch_inputs import InputBuilder, known_only

if TYPE_CHECKING:
    from weft.contracts.speculator import DraftModel

PREFIX = "draft."
"""Prefixed to the draft's KV-cache group and layer names, so they never collide with the target's."""


class DraftOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class _Row:
    """One request's row in a draft forward, in the shape :class:`InputBuilder` reads a request state."""

    __slots__ = ("request_id", "token_ids", "num_computed_tokens", "block_ids")

    def __init__(self, request_id: str, token_ids: list[int], start: int, block_ids: list[list[int]]) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_computed_tokens = start
        self.block_ids = block_ids

    def take_prefix_hit(self) -> int:
        return 0


class _Followed:
    """A request as the draft follows it: its tokens, and how many of them the draft's cache holds."""

    __slots__ = ("token_ids", "cached")

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.cached = 0


class DraftSpeculator(Speculator):
    """Greedy proposals of a draft model with its own paged KV cache (module docstring)."""

    name = "draft"
    owns_model = True
    Options = DraftOptions

    def __init__(self, options: msgspec.Struct | None, config: Any) -> None:
        super().__init__(options, config)
        self.requests: dict[str, _Followed] = {}
        self.draft: DraftModel | None = None
        self._groups: tuple[KVCacheGroupSpec, ...] = ()
        """The draft's KV-cache groups as the engine knows them (names prefixed)."""
        self._own_groups: tuple[KVCacheGroupSpec, ...] = ()
        """The same groups under the draft model's own layer names, which its forward reads."""
        self._inputs: InputBuilder | None = None

    def load(self, models: DraftModelLoader) -> None:
        source = self.config.model
        if not source:
            raise ValueError(
                "[engine.speculative] method = 'draft' needs a draft model: set [engine.speculative] model to a "
                "folder, file or alias of a smaller model with the target's vocabulary"
            )
        draft = models.load(source)
        vocab = draft.config.hf_config.get("vocab_size")
        if self.config.vocab_size and vocab is not None and int(vocab) > self.config.vocab_size:
            raise ValueError(
                f"[engine.speculative] model = {source!r}: its vocabulary ({vocab} tokens) is larger than the "
                f"target's ({self.config.vocab_size}); a draft must share the target's tokenizer"
            )
        groups = draft.family.kv_cache_groups(draft.config)
        managed = [group.name for group in groups if not group.spec.paged_attention]
        if managed:
            raise ValueError(
                f"[engine.speculative] model = {source!r}: its family {type(draft.family).__name__} manages KV-cache "
                f"groups {managed} itself; a draft model needs paged attention in every group"
            )
        self.draft = draft
        self._groups = tuple(
            KVCacheGroupSpec(PREFIX + group.name, tuple(PREFIX + layer for layer in group.layer_names), group.spec)
            for group in groups
        )
        self._own_groups = tuple(groups)

    def kv_cache_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        return self._groups

    def bind_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.draft is not None
        own = {layer[len(PREFIX) :]: tensor for layer, tensor in kv_caches.items()}
        self._inputs = InputBuilder(self.draft.backend, self._own_groups, own, self.draft.device, None, None)

    def add_request(self, request: SpeculationRequest) -> None:
        self.requests[request.request_id] = _Followed([*request.prompt_token_ids, *request.output_token_ids])

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def on_verified(self, results: Sequence[Verified]) -> None:
        for result in results:
            followed = self.requests.get(result.request_id)
            if followed is not None:
                followed.token_ids.extend(result.token_ids)

    @torch.inference_mode()
    def propose(self, step: ProposalStep) -> Proposals:
        assert self.draft is not None and self._inputs is not None, "load and bind_kv_caches come first"
        assert step.draft_inputs is not None, "the runner passes a model-owning speculator its rows' blocks"
        proposals: list[list[int]] = [[] for _ in step.request_ids]
        rows: list[int] = []
        states: list[_Row] = []
        wanted: list[int] = []
        for index, (request_id, limit) in enumerate(zip(step.request_ids, step.max_tokens, strict=True)):
            followed = self.requests.get(request_id)
            if followed is None or limit <= 0:
                continue
            blocks = [list(table) for table in step.draft_inputs.block_ids[index]]
            covered = min(
                (len(table) * group.spec.block_size for table, group in zip(blocks, self._groups, strict=True)),
                default=0,
            )
            newest = len(followed.token_ids) - 1  # the target's own token: fed first, at this position
            count = min(limit, covered - newest)  # proposal j is computed at position newest + j - 1
            if count <= 0:
                continue
            rows.append(index)
            states.append(_Row(request_id, followed.token_ids, followed.cached, blocks))
            wanted.append(count)
        if not rows:
            return Proposals(proposals)
        made = self._draft(states, wanted)
        for row, state, count, tokens in zip(rows, states, wanted, made, strict=True):
            proposals[row] = tokens[:count]
            self.requests[state.request_id].cached = len(state.token_ids)
        return Proposals(proposals)

    def _draft(self, states: list[_Row], wanted: list[int]) -> list[list[int]]:
        """Each row's ``wanted`` greedy tokens: a catch-up forward, then one forward per further token, the
        rows that want fewer dropping out."""
        assert self.draft is not None and self._inputs is not None
        model, device = self.draft.model, self.draft.device
        vocab = self.config.vocab_size or None
        counts = [len(state.token_ids) - state.num_computed_tokens for state in states]
        input_ids, positions, context, query_start = self._inputs.build(states, counts, known_only)
        hidden = model(input_ids, positions, context)
        last = torch.tensor([end - 1 for end in query_start[1:]], dtype=torch.long, device=device)
        drafted = [greedy_in_vocabulary(model.compute_logits(hidden[last]), vocab)]
        active = list(range(len(states)))
        for step in range(1, max(wanted)):
            active = [row for row in active if wanted[row] > step]
            rows = torch.tensor(active, dtype=torch.long, device=device)
            fed = [
                _Row(
                    states[row].request_id,
                    states[row].token_ids,
                    len(states[row].token_ids) - 1 + step,
                    states[row].block_ids,
                )
                for row in active
            ]
            previous = drafted[-1][rows] if len(active) < len(states) else drafted[-1]

            def fill(input_ids: torch.Tensor, _states: list, _counts: list, tokens: torch.Tensor = previous) -> None:
                input_ids.copy_(tokens)

            input_ids, positions, context, _ = self._inputs.build(fed, [1] * len(fed), fill)
            hidden = model(input_ids, positions, context)
            tokens = torch.zeros(len(states), dtype=torch.long, device=device)
            tokens[rows] = greedy_in_vocabulary(model.compute_logits(hidden), vocab)
            drafted.append(tokens)
        table = torch.stack(drafted, dim=1).tolist()
        return [row[:count] for row, count in zip(table, wanted, strict=True)]


def greedy_in_vocabulary(logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """The greedy token of each row, among the target's vocabulary (a draft's logits may be padded wider)."""
    if vocab is not None and logits.shape[-1] > vocab:
        logits = logits[..., :vocab]
    return logits.argmax(dim=-1)
