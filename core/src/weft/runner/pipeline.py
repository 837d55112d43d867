"""One step's forward on a pipeline stage, in micro-batches.

The step's requests are cut into up to ``pipeline_parallel_size`` micro-batches
of consecutive requests with about equal token counts. Each stage runs them in
order: it receives a micro-batch's hidden states from the previous stage (the
first stage embeds the tokens), runs its layers, and sends the result on without
waiting, so while stage ``s`` runs micro-batch ``m`` stage ``s - 1`` already runs
``m + 1``. Every stage knows the step's token counts, so what arrives needs no
shape message: the model's ``intermediate_spec`` says it. The last stage returns
the logits of the sampling rows, in batch order; it samples, and every stage takes
its tokens (:func:`share_sampled`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from weft.runner.sampler import SampledBatch

if TYPE_CHECKING:
    from weft.distributed.state import ParallelGroups
    from weft.layers.attention import ForwardContext
    from weft.runner.request_state import RequestState

PrepareInputs = Callable[
    [list["RequestState"], list[int]], tuple[torch.Tensor, torch.Tensor, "ForwardContext", list[int]]
]
"""The runner's input preparation: token ids, positions, the forward context and where each request starts."""


def micro_batches(counts: list[int], parts: int) -> list[range]:
    """Consecutive runs of requests with about ``sum(counts) / parts`` tokens each (at most ``parts``, none empty)."""
    parts = max(1, min(parts, len(counts)))
    total = sum(counts)
    batches: list[range] = []
    start = running = 0
    for index, count in enumerate(counts):
        running += count
        still_to_open = parts - len(batches) - 1
        requests_left = len(counts) - index - 1
        if still_to_open > 0 and (running * parts >= total * (len(batches) + 1) or requests_left == still_to_open):
            batches.append(range(start, index + 1))
            start = index + 1
    batches.append(range(start, len(counts)))
    return batches


def forward_in_micro_batches(
    model: torch.nn.Module,
    parallel: ParallelGroups,
    prepare_inputs: PrepareInputs,
    states: list[RequestState],
    counts: list[int],
    sampling: list[int],
) -> torch.Tensor | None:
    """This stage's part of the step; on the last stage the logits of the rows in ``sampling``."""
    layout = parallel.layout
    sends = []
    logits = []
    sampled = set(sampling)
    for batch in micro_batches(counts, layout.pipeline_parallel_size):
        batch_states = [states[row] for row in batch]
        batch_counts = [counts[row] for row in batch]
        input_ids, positions, context, query_start = prepare_inputs(batch_states, batch_counts)
        intermediate = None
        if not layout.is_first_stage:
            intermediate = parallel.receive_from_previous_stage(model.intermediate_spec(input_ids.shape[0]))
        output = model(input_ids, positions, context, intermediate)
        if not layout.is_last_stage:
            sends.extend(parallel.send_to_next_stage(output))
            continue
        rows = [query_start[index + 1] - 1 for index, row in enumerate(batch) if row in sampled]
        if rows:
            logits.append(model.compute_logits(output[torch.tensor(rows, device=output.device)]))
    for send in sends:
        send.wait()
    if not layout.is_last_stage or not logits:
        return None
    return torch.cat(logits) if len(logits) > 1 else logits[0]


def share_sampled(
    parallel: ParallelGroups, sampled: SampledBatch | None, count: int, device: torch.device
) -> SampledBatch:
    """The last stage's sampled tokens and statuses (``sampled``; None on the other stages), broadcast to every
    stage: tensor ranks sample alike; the logprobs stay on the last stage, whose output the executor returns."""
    if sampled is not None:
        shared = torch.stack([sampled.tokens, sampled.status])
    else:
        shared = torch.empty((2, count), dtype=torch.long, device=device)
    shared = parallel.broadcast_from_output_rank(shared)
    return SampledBatch(shared[0], shared[1], sampled.logprobs if sampled is not None else None)
