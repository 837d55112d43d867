"""The quantization-method suite of the conformance kit (:mod:`weft.contracts.quantization`)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from weft.testing.suites import _Contract, _platform_under_test


class QuantizationContract(_Contract):
    """The quantization contract (:mod:`weft.contracts.quantization`): a method's ``apply`` equals
    ``x @ dequantize(W)^T + b`` for each weight format, within the method's :attr:`tolerance`
    (relative to the output's largest magnitude).

    The formats checked: GGUF-like 4-bit groups of 32 with an offset (Q4_1, Q4_K) and without
    (Q4_0), 8-bit signed groups (Q8_0), and float weights; each is loaded in two row blocks
    (a stacked q/k/v), as families do. A method that refuses a format raises ValueError at load.
    Set ``platform`` to run on that platform (skipped where not available).
    """

    slot = "quantization"
    platform: ClassVar[str | None] = None
    activation_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16")
    rounded_float_tolerance: ClassVar[float] = 0.1
    """Largest error, relative to the output's magnitude, for float weights the method quantizes itself."""

    @staticmethod
    def weight_formats(out_features: int, in_features: int) -> dict[str, Any]:
        import torch

        from weft.contracts.quantization import GroupAffine

        generator = torch.Generator().manual_seed(0)
        groups = in_features // 32

        def uniform(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=generator) * 0.02 + 0.001

        def codes(low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.randint(low, high, (out_features, in_features), generator=generator).to(dtype)

        scales = uniform(out_features, groups)
        return {
            "Q4_0": GroupAffine(codes(0, 16, torch.uint8), scales, -8 * scales, 32, 4, False, "Q4_0"),
            "Q4_1": GroupAffine(
                codes(0, 16, torch.uint8),
                uniform(out_features, groups),
                -uniform(out_features, groups) * 8,
                32,
                4,
                False,
                "Q4_1",
            ),
            "Q8_0": GroupAffine(
                codes(-128, 128, torch.int8), uniform(out_features, groups) / 8, None, 32, 8, True, "Q8_0"
            ),
            "float": torch.randn(out_features, in_features, generator=generator) * 0.05,
        }

    def test_apply_matches_the_dequantized_reference(self, plugin, weft_registry):
        from weft.contracts.quantization import QuantizationMethod

        assert issubclass(plugin, QuantizationMethod)
        platform = _platform_under_test(weft_registry, self.platform)
        if not plugin.is_available(platform):
            pytest.skip(f"quantization {self.plugin_name!r} {plugin.unavailable_reason(platform)}")
        check_apply(plugin, platform, self.activation_dtypes, self.rounded_float_tolerance)


def check_apply(plugin: Any, platform: Any, activation_dtypes: tuple[str, ...], rounded_float_tolerance: float) -> None:
    """The contract's check of method class ``plugin`` on ``platform``'s device 0: each weight format of
    :meth:`QuantizationContract.weight_formats` loaded in two row blocks, ``apply`` against ``x @ dense^T + b``
    computed on the CPU in float32."""
    import torch
    from torch import nn

    from weft.contracts.quantization import GroupAffine

    device = platform.device(0)
    out_features, in_features = 96, 256
    rtol, atol = plugin.tolerance
    for dtype in activation_dtypes:
        for name, weight in QuantizationContract.weight_formats(out_features, in_features).items():
            method = plugin(platform, dtype)
            layer = nn.Linear(in_features, out_features, bias=True, dtype=getattr(torch, dtype), device=device)
            layer.weight = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
            method.create_weights(layer, in_features, out_features)
            half = out_features // 2
            try:
                method.load_weight(layer, weight.narrow(0, half, out_features - half), half, name)
                method.load_weight(layer, weight.narrow(0, 0, half), 0, name)
            except ValueError:
                continue  # the method refuses this format, as it may
            method.process_weights_after_loading(layer)
            assert method.describe(layer), "describe() must name the effective format"
            dense = weight.dequantize() if isinstance(weight, GroupAffine) else weight
            x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(1))
            bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
            expected = x @ dense.t() + bias
            torch_dtype = getattr(torch, dtype)
            actual = method.apply(layer, x.to(device, torch_dtype), bias.to(device, torch_dtype))
            assert actual.dtype == getattr(torch, dtype) and actual.shape == expected.shape
            scale = expected.abs().max()
            error = ((actual.float().cpu() - expected).abs() - rtol * expected.abs()).max() / scale
            # Float weights the method rounds itself (to 4 bits at worst): a looser bound.
            assert error <= (rounded_float_tolerance if name == "float" else atol), (
                f"{plugin.__name__} on {name} weights, {dtype} activations: error {error:.4f}"
            )
