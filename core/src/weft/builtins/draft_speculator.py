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

All of a step's proposal forwards run on the device; the proposals cross to the host once per step. Where the
engine captures graphs (:meth:`DraftSpeculator.capture_graphs`), the ``k - 1`` one-token forwards after the
catch-up run as one graph per batch size (:class:`DraftGraphs`): each forward's greedy tokens feed the next inside
the graph, so a step's proposals cost one catch-up forward and one replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from weft.contracts.attention import AttentionBatch
from weft.contracts.kv_cache import KVCacheGroupSpec
from weft.contracts.speculator import (
    DraftModelLoader,
    Proposals,
    ProposalStep,
    SpeculationRequest,
    Speculator,
    Verified,
)
from weft.layers.attention import ForwardContext
from weft.runner.batch_inputs import InputBuilder, known_only
from weft.runner.graphs import padded_tables

if TYPE_CHECKING:
    from weft.contracts.platform import Platform
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
        self.graphs: DraftGraphs | None = None
        """The draft's chained one-token forwards, captured per batch size (None: they run eagerly)."""

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

    def capture_graphs(
        self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int
    ) -> float:
        assert self.draft is not None and self._inputs is not None, "load and bind_kv_caches come first"
        steps = self.config.num_speculative_tokens - 1
        if steps < 1:
            return 0.0  # one proposal: the catch-up forward alone makes it
        self.graphs = DraftGraphs(
            self.draft.model,
            self.draft.backend,
            self._own_groups,
            self._inputs.kv_caches,
            self.draft.device,
            steps,
            self.config.vocab_size or None,
        )
        return self.graphs.capture(platform, sizes, scratch_blocks, max_model_len)

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
        size = self.graphs.size_for(len(states)) if self.graphs is not None and max(wanted) > 1 else None
        if size is not None:
            assert self.graphs is not None
            table = self.graphs.run(states, wanted, drafted[0], size).tolist()
            return [row[:count] for row, count in zip(table, wanted, strict=True)]
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


class DraftGraphs:
    """The draft's ``steps`` one-token forwards after its catch-up forward, chained in one graph per batch size:
    step ``j`` feeds each row's proposal ``j`` at position ``newest + j`` and takes its greedy token as proposal
    ``j + 1``, on the device. Every row runs every step; a row that wants fewer proposals holds its last position
    afterwards and writes its keys and values to the scratch block, so it never writes past its blocks. Rows past
    the step's are padding in the scratch blocks. The proposals land in one static ``[size, steps]`` buffer."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        groups: Sequence[KVCacheGroupSpec],
        kv_caches: dict[str, torch.Tensor],
        device: torch.device,
        steps: int,
        vocab: int | None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.groups = tuple(groups)
        self.kv_caches = kv_caches
        self.device = device
        self.steps = steps
        self.vocab = vocab
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays = 0
        """Steps whose proposals came from a replay."""

    def capture(
        self, platform: Platform, sizes: Sequence[int], scratch_blocks: Sequence[int], max_model_len: int
    ) -> float:
        """Capture the chain for each batch size (largest first); returns the seconds it took."""
        started = time.monotonic()
        largest, device = max(sizes), self.device
        self.max_model_len = max_model_len
        self.scratch_slots = [
            block * group.spec.block_size for block, group in zip(scratch_blocks, self.groups, strict=True)
        ]
        self.scratch_blocks = list(scratch_blocks)
        widths = [-(-max_model_len // group.spec.block_size) for group in self.groups]
        self.first = torch.zeros(largest, dtype=torch.long, device=device)
        """Each row's first proposal (the catch-up forward's), fed at the first step."""
        self.newest = torch.zeros(largest, dtype=torch.long, device=device)
        """Each row's newest token's position; step ``j`` feeds position ``newest + j``."""
        self.last = torch.zeros(largest, dtype=torch.long, device=device)
        """Each row's last position to feed: ``newest + wanted - 1`` (padding rows: 0)."""
        self.tables = [torch.zeros(largest, width, dtype=torch.int32, device=device) for width in widths]
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(largest, device=device)
        self.proposals = torch.zeros(largest, self.steps, dtype=torch.long, device=device)
        self._pad(0, largest)
        for size in sorted(set(sizes), reverse=True):
            self.graphs[size] = platform.capture_graph(lambda size=size: self._chain(size))
        return time.monotonic() - started

    def size_for(self, count: int) -> int | None:
        """The captured batch size ``count`` rows replay; None: none is large enough."""
        fitting = [size for size in self.graphs if size >= count]
        return min(fitting) if fitting else None

    def _chain(self, size: int) -> torch.Tensor:
        """What a graph captures: ``steps`` one-token forwards of the first ``size`` rows, each fed the greedy
        tokens of the one before."""
        tokens = self.first[:size]
        newest, last, rows = self.newest[:size], self.last[:size], self.rows[:size]
        for step in range(1, self.steps + 1):
            wanted = newest + step
            active = wanted <= last
            positions = torch.minimum(wanted, last)
            metadata, batches = [], []
            for index, group in enumerate(self.groups):
                table = self.tables[index][:size]
                slots = group.spec.slot_mapping(table, rows, positions)
                batch = AttentionBatch(
                    query_start=self.query_start[: size + 1],
                    seq_lens=(positions + 1).to(torch.int32),
                    block_table=table,
                    slot_mapping=torch.where(active, slots, self.scratch_slots[index]).to(torch.int32),
                    max_query_len=1,
                    max_seq_len=self.max_model_len,
                    block_size=group.spec.block_size,
                )
                batches.append(batch)
                metadata.append(self.backend.build_metadata(batch))
            context = ForwardContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches, batches=batches)
            hidden = self.model(tokens, positions, context)
            tokens = greedy_in_vocabulary(self.model.compute_logits(hidden), self.vocab)
            self.proposals[:size, step - 1].copy_(tokens)
        return self.proposals

    def run(self, states: Sequence[_Row], wanted: list[int], first: torch.Tensor, size: int) -> torch.Tensor:
        """Each row's ``1 + steps`` greedy tokens (``first``, the catch-up's, then the chain's), on the device;
        row ``i``'s first ``wanted[i]`` are its proposals."""
        count = len(states)
        newest = [len(state.token_ids) - 1 for state in states]
        last = [position + n - 1 for position, n in zip(newest, wanted, strict=True)]
        self.first[:count].copy_(first)
        self.newest[:count].copy_(torch.tensor(newest), non_blocking=True)
        self.last[:count].copy_(torch.tensor(last), non_blocking=True)
        for index in range(len(self.groups)):
            host_table = padded_tables([state.block_ids[index] for state in states], self.tables[index].shape[1])
            self.tables[index][:count, : host_table.shape[1]].copy_(host_table, non_blocking=True)
        self._pad(count, size)
        self.replays += 1
        return torch.cat([first.unsqueeze(1), self.graphs[size]()[:count]], dim=1)

    def _pad(self, start: int, stop: int) -> None:
        """Make rows ``start:stop`` padding: at position 0, every block the scratch block."""
        self.first[start:stop] = 0
        self.newest[start:stop] = 0
        self.last[start:stop] = 0
        for index in range(len(self.groups)):
            self.tables[index][start:stop] = self.scratch_blocks[index]
