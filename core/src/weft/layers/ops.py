"""The op implementations a model's layers call, chosen once per engine.

The engine picks an implementation of every op in :data:`LAYER_OPS` for its
platform (:func:`weft.plugins.selection.choose_op`, or what ``[use.ops]``
forces) and builds the model inside :func:`using_ops`; a layer reads its op
with :func:`current_op` when it is constructed and tells it the static shape of
its use through :meth:`~weft.contracts.ops.OpImplementation.declare`, so an
implementation that compiles kernels per shape can warm them all up.
Outside :func:`using_ops` (a model built by hand) layers use plain torch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weft.contracts.ops import OpImplementation

LAYER_OPS: tuple[str, ...] = (
    "linear",
    "rms_norm",
    "rotary",
    "qk_norm_rotary",
    "silu_and_mul",
    "decode_topk",
    "moe",
    "nano_batches",
)
"""Core ops that layers call, core's and model families' alike; their references are in
:mod:`weft.builtins` (``ops``, ``decode_topk``, ``moe``, ``nano_batches``)."""

RUNNER_OPS: tuple[str, ...] = ("bitmask_argmax",)
"""Core ops the model runner calls around the model (reference: :mod:`weft.builtins.bitmask_argmax`); chosen
with the layers' ops, and forced the same way in ``[use.ops]``."""

_active: contextvars.ContextVar[dict[str, OpImplementation]] = contextvars.ContextVar("weft_layer_ops", default={})  # noqa: B039 - never mutated: using_ops sets a new dict


@contextlib.contextmanager
def using_ops(ops: dict[str, OpImplementation]) -> Iterator[None]:
    token = _active.set(dict(ops))
    try:
        yield
    finally:
        _active.reset(token)


def current_op(name: str) -> OpImplementation | None:
    """The implementation of op ``name`` chosen for the model being built; None outside :func:`using_ops`."""
    return _active.get().get(name)
