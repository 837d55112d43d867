"""The forward of one step's batch: eagerly, replaying a captured decode graph, or in pipeline micro-batches.

:class:`BatchForward` decides how a step runs (:class:`~weft.runner.model_runner.ModelRunner` samples what it
returns): a step of decodes only that fits a captured batch size replays the graph over the static inputs
(:class:`~weft.runner.graphs.DecodeGraphs`); a speculating step whose rows feed at most ``1 + k`` tokens each (a
row's last token and its proposals) replays a verify graph (:class:`~weft.runner.graphs.VerifyGraphs`); a step with
a prefill chunk, a resumed prefix hit, images or prompt logprobs, or more rows than the largest size, runs eagerly
over the flat batch
(:class:`~weft.runner.batch_inputs.InputBuilder`); with pipeline stages it runs in micro-batches
(:mod:`weft.runner.pipeline`).

Prompt logprobs: a request that asks for them runs its prefill eagerly, and the step scores each prompt token it
computed from the logits of the position before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from weft.contracts.executor import TokenLogprobs
from weft.contracts.speculator import Speculator, TargetHiddenStates
from weft.distributed.state import ParallelGroups
from weft.layers.attention import ForwardContext
from weft.runner.batch_inputs import FillUnknown, InputBuilder, known_tokens
from weft.runner.graphs import DecodeGraphs, VerifyGraphs
from weft.runner.logits_processors import to_device
from weft.runner.pipeline import forward_in_micro_batches
from weft.runner.request_state import RequestState
from weft.runner.step_handles import PromptLogprobs

if TYPE_CHECKING:
    from weft.runner.kv_connector import WorkerConnector


class BatchForward:
    """Runs a step's forward over the model and returns the logits the step samples from."""

    def __init__(
        self,
        model: torch.nn.Module,
        parallel: ParallelGroups,
        inputs: InputBuilder,
        decode_graphs: DecodeGraphs,
        connector: WorkerConnector | None,
        device: torch.device,
        fill_unknown: FillUnknown,
        speculator: Speculator | None = None,
        verify_graphs: VerifyGraphs | None = None,
    ) -> None:
        """``fill_unknown``: copies into a batch's token ids the tokens the step before sampled that the host has
        not seen yet (:meth:`weft.runner.step_handles.PendingStep.fill_unknown`). ``speculator``: given the hidden
        states of every eager forward when it needs them (MTP, EAGLE: ``needs_hidden_states``)."""
        self.model = model
        self.parallel = parallel
        self.inputs = inputs
        self.decode_graphs = decode_graphs
        self.connector = connector
        self.device = device
        self.fill_unknown = fill_unknown
        self.speculator = speculator if speculator is not None and speculator.needs_hidden_states else None
        self.verify_graphs = verify_graphs
        """The speculating steps' graphs (None, or none captured: those steps run eagerly)."""
        self.last_graph_size: int | None = None
        """The captured batch size the last forward replayed (a decode or a verify graph); None when it ran
        eagerly."""

    def run(
        self,
        states: list[RequestState],
        counts: list[int],
        sampling: list[int],
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]] | None = None,
    ) -> torch.Tensor | None:
        """The logits of the rows in ``sampling`` (None when no row samples, or on a stage before the last), a
        speculating row's at each of its proposals then its last position (``proposals``, by batch row); fills
        ``prompt_logprobs`` (not under pipeline parallelism, which refuses prompt logprobs)."""
        if self.parallel.layout.pipeline_parallel_size > 1:
            return forward_in_micro_batches(self.model, self.parallel, self.prepare_inputs, states, counts, sampling)
        count = len(states)
        scores_prompt = any(
            _scored_prompt_positions(state, count) for state, count in zip(states, counts, strict=False)
        )
        resumes = any(state.prefix_hit is None and state.num_computed_tokens for state in states)
        encoder = self.inputs.encoder
        images = encoder is not None and encoder.needed(states, counts)  # graphs are captured for text
        if self.decode_graphs.graphs and sum(counts) == count and not scores_prompt and not resumes and not images:
            size = self.decode_graphs.size_for(count)
            if size is not None:
                for state in states:
                    state.take_prefix_hit()  # none resumes from a hit here: replays start from the ring as it is
                if self.connector is not None:
                    self.connector.wait_for_all_layers()  # a captured graph's layers wait for nothing
                self.last_graph_size = size
                logits = self._replay(states, size)
                return logits if len(sampling) == count else logits[sampling]
        verifies = proposals and len(sampling) == count and _feeds_proposals_only(counts, proposals)
        if verifies and not scores_prompt and not resumes and not images and self.verify_graphs is not None:
            size = self.verify_graphs.size_for(counts)
            if size is not None:
                if self.connector is not None:
                    self.connector.wait_for_all_layers()
                self.last_graph_size = size
                return self._replay_verify(states, counts, size, proposals)
        self.last_graph_size = None
        return self._execute_eager(states, counts, sampling, prompt_logprobs, proposals or {})

    def _replay(self, states: list[RequestState], size: int) -> torch.Tensor:
        self.decode_graphs.stage(states, size)
        static = self.decode_graphs.static
        assert static is not None
        counts = [1] * len(states)
        static.input_ids[: len(states)].copy_(torch.tensor(known_tokens(states, counts)), non_blocking=True)
        self.fill_unknown(static.input_ids, states, counts)
        return self.decode_graphs.replay(states, size)

    def _replay_verify(
        self, states: list[RequestState], counts: list[int], size: int, proposals: dict[int, list[int]]
    ) -> torch.Tensor:
        """Replay the verify graph of batch ``size``: the logits of each row's proposed positions and its last (every
        row samples: it decodes)."""
        graphs = self.verify_graphs
        assert graphs is not None and graphs.static is not None
        total = sum(counts)
        for state in states:
            state.take_prefix_hit()
        graphs.stage(states, counts, size)
        graphs.static.input_ids[:total].copy_(torch.tensor(known_tokens(states, counts)), non_blocking=True)
        self.fill_unknown(graphs.static.input_ids, states, counts)
        hidden = graphs.replay(size, total)
        rows = _verified_rows(list(range(len(states))), counts, proposals)
        return self.model.compute_logits(hidden[to_device(rows, torch.long, self.device)])

    def _execute_eager(
        self,
        states: list[RequestState],
        counts: list[int],
        sampling: list[int],
        prompt_logprobs: PromptLogprobs,
        proposals: dict[int, list[int]],
    ) -> torch.Tensor | None:
        input_ids, positions, context, query_start = self.prepare_inputs(states, counts)
        hidden = self.model(input_ids, positions, context)
        if self.speculator is not None:
            self.speculator.take_hidden_states(target_hidden_states(self.model, states, counts, hidden))
        _score_prompts(self.model, states, counts, hidden, query_start, prompt_logprobs)
        if not sampling:
            return None
        rows = _verified_rows(sampling, counts, proposals, query_start)
        return self.model.compute_logits(hidden[to_device(rows, torch.long, self.device)])

    def prepare_inputs(
        self, states: list[RequestState], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Token ids, positions and the forward context of ``states`` (``counts`` tokens each); and where
        each request's tokens start in the flat batch (:meth:`InputBuilder.build`)."""
        return self.inputs.build(states, counts, self.fill_unknown)


def _feeds_proposals_only(counts: list[int], proposals: dict[int, list[int]]) -> bool:
    """Whether every row of a step feeds its last token and its proposals (a row without any: one token)."""
    return all(count == 1 + len(proposals.get(row, ())) for row, count in enumerate(counts))


def _verified_rows(
    sampling: list[int], counts: list[int], proposals: dict[int, list[int]], query_start: list[int] | None = None
) -> list[int]:
    """The flat batch rows whose logits the step samples or verifies: each sampling row's proposed positions and its
    last one (``query_start``: where each row's tokens start; default: ``counts`` end to end)."""
    if query_start is None:
        query_start = [0]
        for count in counts:
            query_start.append(query_start[-1] + count)
    rows = []
    for row in sampling:
        end = query_start[row + 1]
        rows.extend(range(end - len(proposals.get(row, ())) - 1, end))
    return rows


_PROMPT_LOGPROB_CHUNK = 256
"""Prompt positions scored at once (their logits are ``chunk x vocab`` floats)."""


def _scored_prompt_positions(state: RequestState, count: int) -> range:
    """Positions of this step whose logits score a prompt token (the next one), for a request that asked."""
    if state.params.prompt_logprobs is None:
        return range(0)
    start = state.num_computed_tokens
    return range(start, min(start + count, state.num_prompt_tokens - 1))


def target_hidden_states(
    model: torch.nn.Module, states: list[RequestState], counts: list[int], hidden: torch.Tensor
) -> TargetHiddenStates:
    """The forward's hidden states as a speculator reads them (``hidden``, or what the model's
    ``hidden_states_for_speculation`` makes of it), with each request's first position and row count."""
    select = getattr(model, "hidden_states_for_speculation", None)
    return TargetHiddenStates(
        [state.request_id for state in states],
        [state.num_computed_tokens for state in states],
        list(counts),
        select(hidden) if select is not None else hidden,
    )


def _score_prompts(
    model: torch.nn.Module,
    states: list[RequestState],
    counts: list[int],
    hidden: torch.Tensor,
    query_start: list[int],
    prompt_logprobs: PromptLogprobs,
) -> None:
    """Score, into ``prompt_logprobs``, the prompt tokens each request that asks for them computed in this step."""
    for row, (state, count) in enumerate(zip(states, counts, strict=False)):
        positions_scored = _scored_prompt_positions(state, count)
        if positions_scored:
            prompt_logprobs[state.request_id] = _score_prompt(model, state, hidden, query_start[row], positions_scored)


def _score_prompt(
    model: torch.nn.Module, state: RequestState, hidden: torch.Tensor, batch_start: int, positions: range
) -> tuple[int, list[TokenLogprobs]]:
    """Logprobs of prompt tokens ``positions.start + 1 ..`` from the logits at ``positions``."""
    top = state.params.prompt_logprobs or 0
    entries: list[TokenLogprobs] = []
    first = batch_start + positions.start - state.num_computed_tokens  # this step's rows start at the computed count
    for chunk in range(0, len(positions), _PROMPT_LOGPROB_CHUNK):
        rows = range(first + chunk, first + min(chunk + _PROMPT_LOGPROB_CHUNK, len(positions)))
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows.start : rows.stop]).float(), dim=-1).cpu()
        targets = torch.tensor(state.token_ids[positions.start + chunk + 1 : positions.start + chunk + 1 + len(rows)])
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        best = logprobs.topk(top, dim=-1) if top else None
        for index in range(len(rows)):
            candidates = (
                list(zip(best.indices[index].tolist(), best.values[index].tolist(), strict=False))
                if best is not None
                else []
            )
            entries.append(TokenLogprobs(float(chosen[index]), int(ranks[index]), candidates))
    return positions.start + 1, entries
