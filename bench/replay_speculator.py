"""A bench-only speculator: proposes each request's recorded greedy continuation (``bench/spec_decode.py``).

Fed the target's own greedy output from a plain run, its proposals are always accepted, so a benchmark with it
measures the verification step alone (a k+1-token forward, the rejection sampler, the bookkeeping), the ceiling
any real speculator's acceptance scales.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from weft.contracts.speculator import Proposals, ProposalStep, SpeculationRequest, Speculator, Verified
from weft.plugins import PluginRegistry
from weft.plugins.discovery import PluginEntry, discover


class ReplaySpeculator(Speculator):
    name = "replay"
    continuations: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    """Each prompt's greedy continuation, set by the benchmark before the engine runs."""

    def __init__(self, options, config) -> None:  # noqa: ANN001 - the contract's
        super().__init__(options, config)
        self._requests: dict[str, tuple[list[int], int]] = {}

    def add_request(self, request: SpeculationRequest) -> None:
        continuation = self.continuations.get(tuple(request.prompt_token_ids), [])
        self._requests[request.request_id] = (continuation, len(request.output_token_ids))

    def propose(self, step: ProposalStep) -> Proposals:
        proposals = []
        for request_id, most in zip(step.request_ids, step.max_tokens, strict=True):
            continuation, done = self._requests[request_id]
            proposals.append(continuation[done : done + most])
        return Proposals(proposals)

    def on_verified(self, results: Sequence[Verified]) -> None:
        for result in results:
            if result.request_id in self._requests:
                continuation, done = self._requests[result.request_id]
                self._requests[result.request_id] = (continuation, done + len(result.token_ids))

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def registry_with_replay() -> PluginRegistry:
    """The installed plugins, the memory loader of ``gpu_common`` and this speculator."""
    entries = [
        PluginEntry(
            slot="loader",
            name="memory",
            target="gpu_common:MemoryLoader",
            distribution="weft-bench",
            version="0",
            core_api="",
            builtin=False,
        ),
        PluginEntry(
            slot="speculator",
            name="replay",
            target=f"{__name__}:ReplaySpeculator",
            distribution="weft-bench",
            version="0",
            core_api="",
            builtin=False,
        ),
    ]
    return PluginRegistry(discover() + entries)
