"""Speculative proposals under a grammar: a mask at every position a step verifies, and the matcher's tentative
advance over the proposals, settled once the step's tokens are known.

A constrained request that verifies proposals ``d_0 .. d_{n-1}`` samples at ``n + 1`` positions; position ``j``
draws the token after ``d_{j-1}`` under the mask of the matcher advanced over ``d_0 .. d_{j-1}``
(:func:`fill_positions`). The matcher takes the proposals tentatively, up to the first one the grammar refuses:
that proposal is masked off at its own position, so the target rejects it there and no later position is kept (their
rows allow every token). After a proposal that ends the grammar, the rows allow every token too: plain decoding
samples freely after the end.

The matcher is left advanced over the proposals it took. When the request's tokens arrive, :func:`settle` keeps
the proposals the step accepted (the matcher already holds them) and rolls back the rest
(:meth:`~weft.contracts.structured_output.GrammarMatcher.rollback`); the tokens past them are accepted as usual. The
settlement compares the advance with the tokens the request really generated next, so a step whose tokens never
come (its request preempted meanwhile) is undone as well, by the next tokens or the next fill.

The fill thread (:mod:`weft.engine.core.structured_output`) and the fill processes
(:mod:`weft.engine.core.grammar_process`) both use these, each over its own matchers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from weft.contracts.structured_output import GrammarMatcher, StructuredOutputBackend
    from weft.engine.core.fill_budget import FillBudget

K = TypeVar("K", bound=Hashable)


def fill_positions(
    backend: StructuredOutputBackend,
    matchers: Sequence[GrammarMatcher],
    proposals: Sequence[Sequence[int]],
    bitmask: torch.Tensor,
    budget: FillBudget | None = None,
    over: set[int] | None = None,
) -> list[list[int]]:
    """Fill ``1 + len(proposals[i])`` rows of ``bitmask`` for each ``matchers[i]``, request after request from row 0:
    the mask at each position it verifies (module docstring). Returns the proposals each matcher took (tentatively:
    :func:`settle` keeps those its step accepts). With a ``budget``, the indices of the matchers one of whose fills
    took longer than it are added to ``over``."""
    import torch  # here: a fill process imports it only once it fills (as it does for its first shared segment)

    def fill(indices: Sequence[int], rows: torch.Tensor) -> None:
        chosen = [matchers[index] for index in indices]
        if budget is None:
            backend.fill_bitmasks(chosen, rows)
            return
        assert over is not None, "a fill budget needs a set to name the matchers over it in"
        over.update(indices[row] for row in budget.fill(backend, chosen, rows))

    count = len(matchers)
    widths = [len(proposed) for proposed in proposals]
    if not any(widths):
        fill(range(count), bitmask[:count])
        return [[] for _ in range(count)]
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width + 1)
    advanced: list[list[int]] = [[] for _ in range(count)]
    going = list(range(count))  # the matchers whose row at this position is a mask
    scratch = torch.empty(count, bitmask.shape[1], dtype=bitmask.dtype)
    for position in range(max(widths) + 1):
        if position:
            stepping = [index for index in going if widths[index] >= position]
            tokens = [proposals[index][position - 1] for index in stepping]
            results = backend.accept_tokens([matchers[index] for index in stepping], tokens)
            going = []
            for index, token, (accepted, terminated) in zip(stepping, tokens, results, strict=True):
                if accepted:
                    advanced[index].append(token)
                if accepted and not terminated:
                    going.append(index)
                else:  # past a refused proposal nothing is kept; past the grammar's end, sampling is free
                    bitmask[starts[index] + position : starts[index + 1]] = -1
        if not going:
            break
        rows = scratch[: len(going)]
        fill(going, rows)
        bitmask.index_copy_(0, torch.tensor([starts[index] + position for index in going]), rows)
    return advanced


def settle(
    advanced: MutableMapping[K, list[int]],
    accepted: Sequence[tuple[K, int]],
    filling: Sequence[K],
    matcher_of: Callable[[K], GrammarMatcher],
) -> tuple[list[int], list[tuple[int, K]]]:
    """Settle the tentative advances (``advanced``: by matcher key, the proposals it took) of the matchers with tokens
    among ``accepted`` (``(key, token)`` in generation order) or about to fill a row (``filling``): each keeps the
    longest prefix of its advance its tokens repeat and rolls back the rest, and leaves ``advanced``.

    Returns the indices into ``accepted`` of the tokens still to accept (those a matcher kept are dropped), and
    ``(index, key)`` for each matcher that ended on the last token it kept (its index into ``accepted``)."""
    positions: dict[K, list[int]] = {}
    for index, (key, _) in enumerate(accepted):
        if key in advanced:
            positions.setdefault(key, []).append(index)
    for key in filling:
        if key in advanced:
            positions.setdefault(key, [])
    kept_indices: set[int] = set()
    ended: list[tuple[int, K]] = []
    for key, indices in positions.items():
        took = advanced.pop(key)
        kept = 0
        while kept < min(len(took), len(indices)) and accepted[indices[kept]][1] == took[kept]:
            kept += 1
        matcher = matcher_of(key)
        if kept < len(took):
            matcher.rollback(len(took) - kept)
        kept_indices.update(indices[:kept])
        if kept and matcher.is_terminated():
            ended.append((indices[kept - 1], key))
    return [index for index in range(len(accepted)) if index not in kept_indices], ended
