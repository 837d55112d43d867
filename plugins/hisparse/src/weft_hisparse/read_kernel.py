"""The Triton kernel that ends a decode graph's read of host entries: each pick from the hot buffer, the host pool or
what the model gathered, and the misses kept copied into their hot-buffer entries, in one launch per layer.

It exists for the bus: the host pool is pinned memory mapped into the device's address space, and every load from
it crosses PCIe. torch's gather has no mask, so it would load a host entry for every pick (the hot buffer's hits
and the GPU pages' picks index some entry too); here a program loads from the host pool only in the branch of a
miss, so only the misses cross the bus.

Imported only on CUDA where Triton is installed (torch's CUDA builds bring it; weft-hisparse does not depend on
it), and on the CPU under ``TRITON_INTERPRET=1`` for tests. It goes through core's warm-up contract
(:mod:`weft.kernels.warmup`) with the entries' dtype and width as its compile key; :class:`GraphReader`
compiles it when the graphs' buffers are allocated, before the first capture.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from weft.api import CompileKey, Kernel


@triton.jit
def _read_host_entries_kernel(
    entries, hot, pool, hot_rows, host_rows, keep_rows, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    """One program per pick: ``hot_rows`` >= 0 reads that hot-buffer row, else ``host_rows`` >= 0 that host-pool row
    (and writes it to hot-buffer row ``keep_rows`` where >= 0); a pick with neither keeps its entry."""
    pick = tl.program_id(0).to(tl.int64)
    hot_row = tl.load(hot_rows + pick)
    host_row = tl.load(host_rows + pick)
    columns = tl.arange(0, BLOCK)
    inside = columns < WIDTH
    if hot_row >= 0:
        tl.store(entries + pick * WIDTH + columns, tl.load(hot + hot_row * WIDTH + columns, mask=inside), mask=inside)
    elif host_row >= 0:  # the only branch that loads from the host pool
        read = tl.load(pool + host_row * WIDTH + columns, mask=inside)
        tl.store(entries + pick * WIDTH + columns, read, mask=inside)
        keep_row = tl.load(keep_rows + pick)
        if keep_row >= 0:
            tl.store(hot + keep_row * WIDTH + columns, read, mask=inside)


class ReadHostEntriesKey(CompileKey, frozen=True):
    dtype: str
    width: int


class ReadHostEntriesKernel(Kernel):
    """Writes into ``entries`` ``[rows, k, width]`` (contiguous) the picks that ``hot_rows``, ``host_rows`` and
    ``keep_rows`` (``[rows, k]`` int64, -1: none) say, from ``hot`` and ``pool`` (``[entries, width]`` rows)."""

    name: ClassVar[str] = "weft_hisparse.read_host_entries"

    def dispatch(self, dtype: torch.dtype, width: int) -> ReadHostEntriesKey:
        return ReadHostEntriesKey(dtype=str(dtype).removeprefix("torch."), width=width)

    def compile(self, key: ReadHostEntriesKey) -> Any:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return key  # interpreted: nothing to compile
        dtype = getattr(torch, key.dtype)
        return _read_host_entries_kernel.warmup(
            dtype,
            dtype,
            dtype,
            torch.int64,
            torch.int64,
            torch.int64,
            grid=(1,),
            **self._constants(key.width),
        )

    @staticmethod
    def _constants(width: int) -> dict[str, int]:
        return dict(WIDTH=width, BLOCK=triton.next_power_of_2(width))

    def launch(
        self,
        compiled: Any,
        *,
        entries: torch.Tensor,
        hot: torch.Tensor,
        pool: torch.Tensor,
        hot_rows: torch.Tensor,
        host_rows: torch.Tensor,
        keep_rows: torch.Tensor,
        **_: Any,
    ) -> None:
        picks = hot_rows.numel()
        if picks:
            _read_host_entries_kernel[(picks,)](
                entries, hot, pool, hot_rows, host_rows, keep_rows, **self._constants(entries.shape[-1])
            )
