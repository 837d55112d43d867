"""References of the ops core's layers call (:data:`weft.layers.ops.LAYER_OPS`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from weft.contracts.ops import OpImplementation


class LinearTorch(OpImplementation):
    """``linear(x, weight, bias)``: ``x @ weight.T + bias``, ``x`` of shape ``[..., in]``, ``weight`` ``[out, in]``.

    Layers declare ``out_features``, ``in_features``, ``bias`` (bool) and ``dtype``.
    """

    op: ClassVar[str] = "linear"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, x: Any, weight: Any, bias: Any = None) -> Any:
        import torch.nn.functional as F

        return F.linear(x, weight, bias)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        generator = torch.Generator().manual_seed(0)
        for rows, out_features, in_features, bias in (
            (1, 96, 64, False),
            (3, 40, 1000, True),
            (4, 256, 512, False),
            (37, 64, 64, True),
        ):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, in_features, generator=generator).to(device, dtype)
                weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(
                    device, dtype
                )
                b = torch.randn(out_features, generator=generator).to(device, dtype) if bias else None
                yield (x, weight, b), {}


class RmsNormTorch(OpImplementation):
    """``rms_norm(x, weight, eps, residual=None)``, as Hugging Face's Llama computes it.

    Without ``residual``: ``weight * (x / rms(x))``, the normalisation in float32 and
    rounded to ``x``'s dtype before the weight multiplies. With ``residual``:
    ``s = x + residual`` (in ``x``'s dtype) is normalised and ``(normed, s)`` returned,
    so a layer's residual add and its next norm are one call. Layers declare
    ``hidden_size`` and ``dtype``.
    """

    op: ClassVar[str] = "rms_norm"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, x: Any, weight: Any, eps: float, residual: Any = None) -> Any:
        from weft.layers.norm import rms_norm

        return rms_norm(x, weight, eps, residual)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        generator = torch.Generator().manual_seed(0)
        for rows, hidden in ((1, 64), (5, 128), (33, 96), (3, 4096)):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, hidden, generator=generator).to(device, dtype)
                weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(device, dtype)
                residual = torch.randn(rows, hidden, generator=generator).to(device, dtype)
                yield (x, weight, 1e-6), {}
                yield (x, weight, 1e-5), {"residual": residual}


class RotaryTorch(OpImplementation):
    """``rotary(query, key, cos, sin)``: rotate ``[T, heads, dim]`` queries and keys (``rotate_half`` layout).

    ``cos``/``sin`` are ``[T, 1, dim]`` in the model's dtype (:meth:`RotaryEmbedding.table`);
    returns new ``(query, key)``. Layers declare ``num_heads``, ``num_kv_heads``,
    ``head_dim`` and ``dtype``.
    """

    op: ClassVar[str] = "rotary"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, query: Any, key: Any, cos: Any, sin: Any) -> Any:
        from weft.layers.rotary import apply_rotary

        return apply_rotary(query, key, cos, sin)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        generator = torch.Generator().manual_seed(0)
        for tokens, heads, kv_heads, dim in ((1, 4, 2, 64), (7, 8, 8, 128), (19, 16, 4, 32)):
            for dtype in (torch.float32, torch.bfloat16):
                # Query and key as views of one fused projection, as models produce them.
                fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(device, dtype)
                query = fused[:, : heads * dim].view(tokens, heads, dim)
                key = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
                angles = torch.rand(tokens, 1, dim // 2, generator=generator) * 6.28
                cos = torch.cat([angles.cos()] * 2, -1).to(device, dtype)
                sin = torch.cat([angles.sin()] * 2, -1).to(device, dtype)
                yield (query, key, cos, sin), {}


def qk_norm_rotary(query: Any, key: Any, query_weight: Any, key_weight: Any, eps: float, cos: Any, sin: Any) -> Any:
    """Per-head RMSNorm of queries and keys (weights ``[dim]``), then the rotary embedding
    (:class:`QkNormRotaryTorch`)."""
    from weft.layers.norm import rms_norm
    from weft.layers.rotary import apply_rotary

    return apply_rotary(rms_norm(query, query_weight, eps), rms_norm(key, key_weight, eps), cos, sin)


class QkNormRotaryTorch(OpImplementation):
    """``qk_norm_rotary(query, key, query_weight, key_weight, eps, cos, sin)``: Qwen3's attention input.

    Every ``[dim]`` head of ``query`` ``[T, heads, dim]`` and ``key`` ``[T, kv_heads, dim]`` is
    normalised as ``rms_norm(head, weight, eps)`` (``query_weight`` / ``key_weight``, ``[dim]``), then
    both are rotated as ``rotary(query, key, cos, sin)``; returns new ``(query, key)``. Queries and
    keys may be strided views of one fused projection. Layers declare ``num_heads``,
    ``num_kv_heads``, ``head_dim`` and ``dtype``.
    """

    op: ClassVar[str] = "qk_norm_rotary"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, query: Any, key: Any, query_weight: Any, key_weight: Any, eps: float, cos: Any, sin: Any) -> Any:
        return qk_norm_rotary(query, key, query_weight, key_weight, eps, cos, sin)

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        generator = torch.Generator().manual_seed(0)
        for tokens, heads, kv_heads, dim in ((1, 4, 2, 64), (7, 8, 8, 128), (19, 16, 4, 32), (5, 14, 2, 128)):
            for dtype in (torch.float32, torch.bfloat16):
                fused = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator).to(device, dtype) * 4
                query = fused[:, : heads * dim].view(tokens, heads, dim)
                key = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
                query_weight = (1 + 0.3 * torch.randn(dim, generator=generator)).to(device, dtype)
                key_weight = (1 + 0.3 * torch.randn(dim, generator=generator)).to(device, dtype)
                angles = torch.rand(tokens, 1, dim // 2, generator=generator) * 6.28
                cos = torch.cat([angles.cos()] * 2, -1).to(device, dtype)
                sin = torch.cat([angles.sin()] * 2, -1).to(device, dtype)
                yield (query, key, query_weight, key_weight, 1e-6, cos, sin), {}


class SiluAndMulTorch(OpImplementation):
    """``silu_and_mul(x)``: ``silu(x[..., :d]) * x[..., d:]`` for ``x`` of width ``2d`` (a fused gate/up output).

    Layers declare ``width`` (d) and ``dtype``.
    """

    op: ClassVar[str] = "silu_and_mul"
    reference: ClassVar[bool] = True
    priority: ClassVar[int] = -100

    def __call__(self, x: Any) -> Any:
        import torch.nn.functional as F

        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        import torch

        generator = torch.Generator().manual_seed(0)
        for rows, width in ((1, 128), (6, 320), (40, 64)):
            for dtype in (torch.float32, torch.bfloat16):
                yield (torch.randn(rows, 2 * width, generator=generator).to(device, dtype) * 3,), {}
