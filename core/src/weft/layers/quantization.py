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
