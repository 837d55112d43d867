"""The quantization method linear layers ask for while a model is built (:mod:`weft.contracts.quantization`).

The worker builds the model inside :func:`using_quantization`; each :class:`~weft.layers.linear.Linear`
reads :func:`current_quantization` when constructed. Outside it (a model built by hand, or
``engine.quantization = "none"``) layers keep dense weights. :func:`process_quantized_layers` runs
each layer's method once the family has loaded every weight.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from weft.contracts.quantization import QuantizationMethod

_active: contextvars.ContextVar[QuantizationMethod | None] = contextvars.ContextVar("weft_quantization", default=None)


@contextlib.contextmanager
def using_quantization(method: QuantizationMethod | None) -> Iterator[None]:
    token = _active.set(method)
    try:
        yield
    finally:
        _active.reset(token)


def current_quantization() -> QuantizationMethod | None:
    """The method of the model being built; None outside :func:`using_quantization`."""
    return _active.get()


def quantization_notes(config, registry) -> list[str]:
    """What ``engine.quantization`` resolves to for the configured model and platform, and what each format
    becomes (``weft config show`` prints these lines); resolving the model reads its metadata, not its weights."""
    from weft.resolve import build_platform, choose_quantization, resolve_dtype, resolve_source

    platform = build_platform(registry, config)
    _, source = resolve_source(registry, config)
    name, method = choose_quantization(registry, config, platform, source.format, resolve_dtype(config, platform))
    if method is None:
        return [
            f"quantization: none ({source.format} model on {platform.name}): dense weights in "
            f"{resolve_dtype(config, platform)}, quantized checkpoint tensors dequantized at load"
        ]
    lines = [
        f"quantization: {name} (engine.quantization = {config.engine.quantization!r}; "
        f"{source.format} model on {platform.name})"
    ]
    lines += [f"  {source_format} -> {target}" for source_format, target in method.conversions.items()]
    return lines


def process_quantized_layers(module: nn.Module) -> Counter[str]:
    """Let each quantized layer's method pack its loaded weights; returns how many layers took each format."""
    formats: Counter[str] = Counter()
    for layer in module.modules():
        method = getattr(layer, "quantization", None)
        if method is not None:
            if layer.weight.numel() and hasattr(layer, "load_tied_weight"):
                layer.load_tied_weight()
            method.process_weights_after_loading(layer)
            formats[method.describe(layer)] += 1
    return formats
