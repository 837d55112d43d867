"""Tensor-parallel collectives on NVIDIA GPUs: one-shot all-reduces over NVLink peer memory, NCCL beyond.

An eager NCCL all-reduce costs a fixed ~35 us on two H200s whatever its size up to
megabytes, and NCCL calls captured in a CUDA graph hung there. A Llama-3-8B decode step
makes 65 all-reduces, so batch-1 tensor parallelism needs both cheaper and capturable
ones. torch's symmetric memory gives them: every rank maps one buffer of every peer, and
``one_shot_all_reduce_copy_out`` copies the input into this rank's buffer, waits for the
peers on device-side signal pads, sums every peer's buffer into the output and waits
again before it returns (so the next call may reuse the buffer). No host synchronisation,
no multicast (NVLink SHARP stays off): a single kernel, captured like any other.

Messages up to :data:`SYMMETRIC_BYTES` in bfloat16 or float32 take that path, eagerly and
inside graphs; larger ones (long prefills) take NCCL, which graphs never capture: decode
graphs whose all-reduces would not fit are refused at capture with the sizes and the fix.
All-gathers of small tensors (the LM head's logits at decode, expert parallelism's routing and
outputs) are an all-reduce of the rank's shard in place in a zero tensor, and small reduce-scatters
an all-reduce of which the rank keeps its rows: each moves what one all-reduce moves, but stays one
capturable kernel; larger ones are NCCL's.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from weft.contracts.parallel import Communicator

logger = logging.getLogger("weft.cuda")

SYMMETRIC_BYTES = 32 << 20
"""Symmetric buffer per rank: a decode step of 512 sequences of an 8192-wide model in bfloat16 is 8 MiB;
the LM head's logits of a few sequences fit too."""

ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
"""What torch's one-shot kernel sums (it has no float16 instance)."""


class CudaCommunicator(Communicator):
    def __init__(self, group: Any, device: torch.device) -> None:
        super().__init__(group, device)
        self.buffer: torch.Tensor | None = None
        self.group_name = group.group_name if group is not None else ""
        if self.size > 1:
            self.buffer = self._symmetric_buffer()

    def _symmetric_buffer(self) -> torch.Tensor | None:
        try:
            import torch.distributed._symmetric_memory as symmetric_memory

            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
                raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out")
            enable = getattr(symmetric_memory, "enable_symm_mem_for_group", None)
            if enable is not None:
                with warnings.catch_warnings():  # deprecated (a no-op) in newer torch, required in older
                    warnings.simplefilter("ignore")
                    enable(self.group_name)
            buffer = symmetric_memory.empty(SYMMETRIC_BYTES, dtype=torch.uint8, device=self.device)
            symmetric_memory.rendezvous(buffer, self.group_name)
            return buffer
        except Exception as error:  # noqa: BLE001 - NCCL still works: tell why graphs will not capture
            logger.warning(
                "tensor parallelism: no symmetric memory over NVLink (%s: %s); all-reduces go through NCCL "
                "and decode runs without CUDA graphs",
                type(error).__name__,
                error,
            )
            return None

    def can_capture(self, dtype: torch.dtype) -> bool:
        return self.size == 1 or (self.buffer is not None and dtype in ONE_SHOT_DTYPES)

    def _fits(self, tensor: torch.Tensor) -> bool:
        size = tensor.numel() * tensor.element_size()
        # The kernel moves 16-byte vectors: the buffer's view and the input must agree on that alignment.
        return (
            self.buffer is not None and tensor.dtype in ONE_SHOT_DTYPES and size <= SYMMETRIC_BYTES and size % 16 == 0
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        if self._fits(tensor):
            assert self.buffer is not None
            local = tensor.contiguous()
            if local.data_ptr() % 16:
                local = local.clone()
            staging = self.buffer.view(local.dtype)[: local.numel()].view_as(local)
            output = torch.empty_like(local)
            return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, local, "sum", self.group_name, output)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"a decode graph would all-reduce {tensor.numel() * tensor.element_size() / 2**20:.1f} MiB of "
                f"{tensor.dtype}, beyond the {SYMMETRIC_BYTES >> 20} MiB symmetric buffer (NCCL cannot be captured); "
                f"lower engine.graph_batch_sizes / engine.max_num_seqs, or set engine.enforce_eager = true"
            )
        return super().all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return tensor
        dim = dim % tensor.dim()
        shape = list(tensor.shape)
        width = shape[dim]
        shape[dim] = width * self.size
        gathered = tensor.new_zeros(shape)
        if not self._fits(gathered):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("an all-gather too large for the symmetric buffer cannot be captured in a graph")
            return super().all_gather(tensor, dim)
        gathered.narrow(dim, self.rank * width, width).copy_(tensor)
        return self.all_reduce(gathered)

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor
        if tensor.shape[0] % self.size:
            raise ValueError(f"reduce_scatter: {tensor.shape[0]} rows do not split evenly over {self.size} ranks")
        rows = tensor.shape[0] // self.size
        if self._fits(tensor):
            return self.all_reduce(tensor).narrow(0, self.rank * rows, rows)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a reduce-scatter too large for the symmetric buffer cannot be captured in a graph")
        return super().reduce_scatter(tensor)

    def close(self) -> None:
        self.buffer = None
