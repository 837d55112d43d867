"""mHC (manifold-constrained hyper-connections): the ``hc_mult`` residual streams collapsed before
and mixed after every sub-block, with Sinkhorn-normalised (doubly stochastic) mixing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from weft_dsv4.config import DeepseekV4Settings
from weft_dsv4.norm import unweighted_rms_norm

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

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pre`` ``[T, n]``, ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` (fp32) of streams ``[T, n, H]``."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iterations - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        # comb is applied transposed: stream k gets sum_j comb[j, k] * streams[j].
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


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
