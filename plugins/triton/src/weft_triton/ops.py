"""weft-triton's implementations of core ops: on every platform whose Triton backend is installed.

Each is available where :func:`weft_triton.runtime.runs_on` says the platform's Triton backend is
installed (NVIDIA, AMD, Intel XPU); elsewhere the op's torch reference is chosen. The kernels are
imported when an implementation is built, so this module imports without Triton.
"""

from __future__ import annotations

from typing import Any, ClassVar

from weft.contracts.ops import OpImplementation
from weft_triton.decode_topk_policy import DecodeTopKLaunch, decode_topk_launch
from weft_triton.runtime import runs_on


class LinearTriton(OpImplementation):
    """``linear`` with the Triton skinny-matrix kernel for one row of bf16/fp16 on the matrices where it
    beat cuBLAS on an H200 (:func:`weft_triton.gemv.pays`); the vendor's BLAS through ``F.linear`` otherwise.

    Batch-1 decode is where cuBLAS streams small weight matrices well below the
    memory bandwidth (see docs/benchmarks.md); larger batches are compute-shaped
    and go to the BLAS unchanged. The threshold was measured on NVIDIA only; force
    ``[use.ops] linear = "torch"`` to keep every projection on hipBLASLt or oneDNN.
    """

    op: ClassVar[str] = "linear"
    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (2e-2, 2e-2)

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        from weft.api import register
        from weft_triton.gemv import GemvKernel

        self.kernel = register(GemvKernel())

    @classmethod
    def is_available(cls, platform: Any) -> bool:
        return runs_on(platform)

    def declare(self, **shape: Any) -> None:
        import torch

        from weft_triton.gemv import pays

        if shape["dtype"] in (torch.bfloat16, torch.float16) and pays(shape["out_features"], shape["in_features"]):
            self.kernel.add_shape(shape["out_features"], shape["in_features"], shape["bias"], shape["dtype"])

    def __call__(self, x: Any, weight: Any, bias: Any = None) -> Any:
        import torch
        import torch.nn.functional as F

        from weft_triton.gemv import MAX_ROWS, pays

        rows = x.numel() // x.shape[-1]
        if (
            rows > MAX_ROWS
            or x.dtype not in (torch.bfloat16, torch.float16)
            or x.dtype != weight.dtype
            or not pays(*weight.shape)
        ):
            return F.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if not flat.is_contiguous() or flat.data_ptr() % 16:  # the kernel was compiled for aligned rows
            flat = flat.clone(memory_format=torch.contiguous_format)
        out_features, in_features = weight.shape
        y = self.kernel(
            dtype=x.dtype,
            n=out_features,
            k=in_features,
            m=rows,
            has_bias=bias is not None,
            x=flat,
            weight=weight,
            bias=bias,
        )
        return y.reshape(*x.shape[:-1], out_features)


class _FusedOp(OpImplementation):
    """A weft-triton fused kernel for half-precision tensors; float32 goes to core's reference."""

    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (2e-2, 2e-2)
    kernel_class: ClassVar[str]

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        import weft_triton.fused as fused
        from weft.api import register

        self.kernel = register(getattr(fused, self.kernel_class)())

    @classmethod
    def is_available(cls, platform: Any) -> bool:
        return runs_on(platform)

    @staticmethod
    def fused(dtype: Any) -> bool:
        import torch

        return dtype in (torch.bfloat16, torch.float16)


class RmsNormTriton(_FusedOp):
    """``rms_norm`` (with the residual add) in one kernel per call."""

    op: ClassVar[str] = "rms_norm"
    kernel_class: ClassVar[str] = "RmsNormKernel"

    def declare(self, **shape: Any) -> None:
        if self.fused(shape["dtype"]):
            self.kernel.add(shape["dtype"], (shape["hidden_size"],))

    def __call__(self, x: Any, weight: Any, eps: float, residual: Any = None) -> Any:
        from weft.api import rms_norm

        if not self.fused(x.dtype) or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
            return rms_norm(x, weight, eps, residual)
        x = x.contiguous()
        residual = residual.contiguous() if residual is not None else None
        return self.kernel(
            dtype=x.dtype,
            shape=(x.shape[-1],),
            flag=residual is not None,
            x=x,
            weight=weight,
            eps=eps,
            residual=residual,
        )


class RotaryTriton(_FusedOp):
    """``rotary`` for queries and keys of one token in one program, read in place from the fused projection."""

    op: ClassVar[str] = "rotary"
    kernel_class: ClassVar[str] = "RotaryKernel"

    def declare(self, **shape: Any) -> None:
        if self.fused(shape["dtype"]) and shape["head_dim"] % 16 == 0:
            self.kernel.add(shape["dtype"], (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]))

    def __call__(self, query: Any, key: Any, cos: Any, sin: Any) -> Any:
        from weft.api import apply_rotary

        dim = query.shape[-1]
        usable = (
            self.fused(query.dtype)
            and dim % 16 == 0
            and key.dtype == query.dtype == cos.dtype == sin.dtype
            and query.stride(-1) == key.stride(-1) == 1
            and query.stride(1) == key.stride(1) == dim
        )
        if not usable:
            return apply_rotary(query, key, cos, sin)
        cos, sin = cos.contiguous(), sin.contiguous()
        return self.kernel(
            dtype=query.dtype, shape=(query.shape[1], key.shape[1], dim), query=query, key=key, cos=cos, sin=sin
        )


class QkNormRotaryTriton(_FusedOp):
    """``qk_norm_rotary``: each query and key head RMS-normalised then rotated, one program per token, read in
    place from the fused projection (no copies to make the heads contiguous first)."""

    op: ClassVar[str] = "qk_norm_rotary"
    kernel_class: ClassVar[str] = "QkNormRotaryKernel"

    def declare(self, **shape: Any) -> None:
        if self.fused(shape["dtype"]) and shape["head_dim"] % 16 == 0:
            self.kernel.add(shape["dtype"], (shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]))

    def __call__(self, query: Any, key: Any, query_weight: Any, key_weight: Any, eps: float, cos: Any, sin: Any) -> Any:
        from weft.api import qk_norm_rotary

        dim = query.shape[-1]
        usable = (
            self.fused(query.dtype)
            and dim % 16 == 0
            and key.dtype == query.dtype == cos.dtype == sin.dtype == query_weight.dtype == key_weight.dtype
            and query.stride(-1) == key.stride(-1) == 1
            and query.stride(1) == key.stride(1) == dim
        )
        if not usable:
            return qk_norm_rotary(query, key, query_weight, key_weight, eps, cos, sin)
        cos, sin = cos.contiguous(), sin.contiguous()
        return self.kernel(
            dtype=query.dtype,
            shape=(query.shape[1], key.shape[1], dim),
            query=query,
            key=key,
            query_weight=query_weight.contiguous(),
            key_weight=key_weight.contiguous(),
            eps=eps,
            cos=cos,
            sin=sin,
        )


class SiluAndMulTriton(_FusedOp):
    op: ClassVar[str] = "silu_and_mul"
    kernel_class: ClassVar[str] = "SiluAndMulKernel"

    def declare(self, **shape: Any) -> None:
        if self.fused(shape["dtype"]):
            self.kernel.add(shape["dtype"], (shape["width"],))

    def __call__(self, x: Any) -> Any:
        import torch.nn.functional as F

        if not self.fused(x.dtype):
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        x = x.contiguous()
        return self.kernel(dtype=x.dtype, shape=(x.shape[-1] // 2,), x=x)


class DecodeTopKTriton(OpImplementation):
    """``decode_topk`` in one Triton launch whose geometry follows the launch policy for the device's
    architecture (:mod:`weft_triton.decode_topk_policy`); the platform's ``arch`` option forces one."""

    op: ClassVar[str] = "decode_topk"
    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        from weft_triton.decode_topk import DecodeTopKLauncher

        self.launcher = DecodeTopKLauncher()
        self._archs: dict[Any, str] = {}

    @classmethod
    def is_available(cls, platform: Any) -> bool:
        return runs_on(platform)

    @property
    def counters(self) -> Any:
        """The completion counters (all zero between launches); None before the first launch."""
        return self.launcher.counters

    def arch(self, device: Any) -> str:
        """The architecture the launch policy tunes for on ``device`` (``""`` without a GPU platform)."""
        if device not in self._archs:
            launch_arch = getattr(self.platform, "launch_arch", None)
            self._archs[device] = launch_arch(device) if launch_arch is not None else ""
        return self._archs[device]

    def launch_for(self, scores: Any, topk: int) -> DecodeTopKLaunch:
        """The geometry the policy gives for these scores on this device."""
        heads, total_q, capacity = scores.shape
        return decode_topk_launch(self.arch(scores.device), topk, capacity, total_q, heads)

    def __call__(
        self,
        scores: Any,
        seq_lens: Any,
        decode_query_len: int,
        block_size: int,
        topk: int,
        launch: DecodeTopKLaunch | None = None,
    ) -> Any:
        """The op; ``launch`` overrides the policy's geometry (which never changes the result)."""
        from weft.api import check_decode_topk_inputs

        check_decode_topk_inputs(scores, seq_lens, decode_query_len, block_size, topk)
        return self.launcher(
            scores, seq_lens, decode_query_len, block_size, topk, launch or self.launch_for(scores, topk)
        )


class BitmaskArgmaxTriton(OpImplementation):
    """``bitmask_argmax`` in one Triton launch (:mod:`weft_triton.bitmask_argmax`); the runner declares the
    dtypes its logits come in, so the kernel is compiled at warm-up."""

    op: ClassVar[str] = "bitmask_argmax"
    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        from weft.api import register
        from weft_triton.bitmask_argmax import BitmaskArgmaxKernel

        self.kernel = register(BitmaskArgmaxKernel())

    @classmethod
    def is_available(cls, platform: Any) -> bool:
        return runs_on(platform)

    def declare(self, **shape: Any) -> None:
        self.kernel.add(shape["dtype"])

    def __call__(self, logits: Any, mask_rows: Any, bitmask: Any) -> Any:
        from weft.api import check_bitmask_argmax_inputs

        check_bitmask_argmax_inputs(logits, mask_rows, bitmask)
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        return self.kernel(
            dtype=logits.dtype, logits=logits, mask_rows=mask_rows.contiguous(), bitmask=bitmask.contiguous()
        )


class MoETriton(OpImplementation):
    """``moe`` with the experts as two grouped GEMMs over the pairs sorted by expert
    (:mod:`weft_triton.fused_moe`); the routing and the shared expert as in the reference."""

    op: ClassVar[str] = "moe"
    priority: ClassVar[int] = 10
    tolerance: ClassVar[tuple[float, float]] = (2e-2, 2e-2)

    def __init__(self, platform: Any) -> None:
        super().__init__(platform)
        from weft.api import register
        from weft_triton.fused_moe import FusedMoEKernel

        self.kernel = register(FusedMoEKernel())

    @classmethod
    def is_available(cls, platform: Any) -> bool:
        return runs_on(platform)

    def declare(self, **shape: Any) -> None:
        self.kernel.add(
            shape["dtype"],
            shape["num_experts"],
            shape["top_k"],
            shape["hidden_size"],
            shape["intermediate_size"],
            shape["bias"],
        )

    def __call__(self, hidden: Any, router_logits: Any, w13: Any, w2: Any, routing: Any, **kwargs: Any) -> Any:
        from weft.api import moe

        return moe(hidden, router_logits, w13, w2, routing, experts_function=self.experts, **kwargs)

    def experts(
        self,
        hidden: Any,
        w13: Any,
        w2: Any,
        experts: Any,
        weights: Any,
        activation: Any,
        w13_bias: Any,
        w2_bias: Any,
        first_expert: int,
    ) -> Any:
        from weft_triton.fused_moe import fused_moe

        return fused_moe(self.kernel, hidden, w13, w2, experts, weights, activation, w13_bias, w2_bias, first_expert)
