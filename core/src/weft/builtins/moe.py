"""The ``moe`` op's reference: routing and the experts of a mixture-of-experts block in plain torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from weft.contracts.ops import OpImplementation


class MoETorch(OpImplementation):
    """``moe(hidden, router_logits, w13, w2, routing, *, activation, correction_bias, w13_bias, w2_bias, topk,
    first_expert, shared_w13, shared_w2)``: a sparse MoE block's output ``[T, H]`` in ``hidden``'s dtype.

    - ``hidden`` ``[T, H]``; ``router_logits`` ``[T, E_all]`` (the router's output; None when ``topk`` is given).
    - ``routing`` (:class:`~weft.layers.moe.MoERouting`) picks each token's ``top_k`` experts and weights
      (:func:`~weft.layers.moe.select_experts`; ``correction_bias`` ``[E_all]`` steers only the choice);
      ``topk = (experts [T, k] int64, weights [T, k])`` replaces the routing (hash routing, expert parallelism).
    - ``w13`` ``[E, 2I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]`` are the experts this rank
      holds, ``first_expert ..``; pairs routed to other experts (or to -1) add nothing. Optional biases
      ``w13_bias`` ``[E, 2I]``, ``w2_bias`` ``[E, H]``.
    - ``activation`` (:class:`~weft.layers.moe.MoEActivation`) of gate and up: ``silu`` or gpt-oss's
      ``swiglu_oai``, optionally clamped.
    - ``shared_w13`` ``[2S, H]`` / ``shared_w2`` ``[H, S]``: a shared expert every token runs, added unweighted.

    The routed products are weighted and summed over a token's choices in float32. Layers declare
    ``num_experts`` (held), ``top_k``, ``hidden_size``, ``intermediate_size`` (held columns), ``dtype``,
    ``activation`` and ``bias``.
    """

    op: ClassVar[str] = "moe"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, hidden: Any, router_logits: Any, w13: Any, w2: Any, routing: Any, **kwargs: Any) -> Any:
        from weft.layers.moe import moe

        return moe(hidden, router_logits, w13, w2, routing, **kwargs)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        from weft.layers.moe import MoEActivation, MoERouting

        generator = torch.Generator().manual_seed(0)

        def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

        # (tokens, experts, top_k, hidden, intermediate): many experts, top-k 1, 2 and 8, more experts than
        # pairs (experts that receive no token), and one token.
        shapes = ((1, 8, 2, 64, 32), (5, 64, 1, 32, 16), (7, 16, 8, 64, 48), (33, 128, 2, 32, 32), (3, 4, 4, 16, 8))
        for tokens, experts, top_k, hidden_size, intermediate in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                hidden = randn(tokens, hidden_size, dtype=dtype)
                logits = randn(tokens, experts, scale=2.0)
                w13 = randn(experts, 2 * intermediate, hidden_size, scale=hidden_size**-0.5, dtype=dtype)
                w2 = randn(experts, hidden_size, intermediate, scale=intermediate**-0.5, dtype=dtype)
                yield (hidden, logits, w13, w2, MoERouting(top_k=top_k)), {}
                yield (hidden, logits, w13, w2, MoERouting(top_k=top_k, renormalize=False)), {}
                sigmoid = MoERouting(top_k=top_k, scoring="sigmoid", scaling=2.5)
                yield (hidden, logits, w13, w2, sigmoid), {"correction_bias": randn(experts, scale=0.1)}
                if experts % 4 == 0 and top_k <= experts // 2:
                    grouped = MoERouting(top_k=top_k, scoring="sigmoid", num_groups=4, topk_groups=2)
                    yield (hidden, logits, w13, w2, grouped), {"correction_bias": randn(experts, scale=0.1)}
                oai = MoEActivation(kind="swiglu_oai", limit=1.5)
                yield (
                    (hidden, logits, w13, w2, MoERouting(top_k=top_k)),
                    {
                        "activation": oai,
                        "w13_bias": randn(experts, 2 * intermediate, dtype=dtype),
                        "w2_bias": randn(experts, hidden_size, dtype=dtype),
                    },
                )
                shared = {
                    "shared_w13": randn(2 * intermediate, hidden_size, scale=hidden_size**-0.5, dtype=dtype),
                    "shared_w2": randn(hidden_size, intermediate, scale=intermediate**-0.5, dtype=dtype),
                    "activation": MoEActivation(limit=2.0),
                }
                yield (hidden, logits, w13, w2, MoERouting(top_k=top_k, scoring="sqrtsoftplus")), shared
                # Precomputed routing over this rank's half of the experts (expert parallelism, hash routing).
                chosen = torch.randint(0, experts, (tokens, top_k), generator=generator).to(device)
                held = experts // 2
                yield (
                    (hidden, None, w13[:held], w2[:held], MoERouting(top_k=top_k)),
                    {
                        "topk": (chosen, torch.rand(tokens, top_k, generator=generator).to(device)),
                        "first_expert": experts - held,
                    },
                )
