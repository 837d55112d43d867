"""mHC (manifold-constrained hyper-connections): the ``hc_mult`` residual streams collapsed before
and mixed after every sub-block, with Sinkhorn-normalised (doubly stochastic) mixing."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from weft_dsv4.config import DeepseekV4Settings
from weft_dsv4.norm import unweighted_rms_norm


def mhc_weights(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, iterations: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: ``pre``, ``post`` and Sinkhorn-normalised ``comb`` from the ``fn`` projection
    ``[T, (2 + n) * n]``."""
    n = int((mixes.shape[-1] + 1) ** 0.5) - 1
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperConnection(nn.Module):
    """mHC weights of one sub-block: ``pre`` collapses the streams, ``post`` expands the block output,
    ``comb`` (Sinkhorn-normalised, doubly stochastic) mixes the residual streams."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        n = s.hc_mult
        self.hc_mult, self.iterations, self.hc_eps, self.norm_eps = n, s.hc_sinkhorn_iters, s.hc_eps, s.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * s.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.kernel: Any = None
        """The fused Triton kernel (:class:`weft_dsv4.mhc_kernel.MhcWeightsKernel`) where the family chose it."""

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pre`` ``[T, n]``, ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` (fp32) of streams ``[T, n, H]``."""
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        if self.kernel is not None:
            return self.kernel(
                mixes=mixes, base=self.base, scale=self.scale, eps=self.hc_eps, iterations=self.iterations
            )
        return mhc_weights(mixes, self.base, self.scale, self.hc_eps, self.iterations)

    @staticmethod
    def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        # comb is applied transposed: stream k gets sum_j comb[j, k] * streams[j].
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


def fused_kernel(device: torch.device, hc_mult: int) -> Any:
    """The Triton kernel of mHC's weights, registered for warm-up, on a device Triton compiles for;
    None (the torch reference) elsewhere, the CPU included."""
    if device.type not in ("cuda", "xpu") or importlib.util.find_spec("triton") is None:
        return None
    from weft.api import register
    from weft_dsv4.mhc_kernel import MhcWeightsKernel

    kernel = MhcWeightsKernel()
    kernel.add(hc_mult)
    return register(kernel)


class HyperHead(nn.Module):
    """Collapses the streams once, before the final norm."""

    def __init__(self, s: DeepseekV4Settings) -> None:
        super().__init__()
        n = s.hc_mult
        self.hc_eps, self.norm_eps = s.hc_eps, s.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * s.hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
