"""The ops slot: named kernels with a torch reference and per-platform implementations.

An op is defined by its reference: an :class:`OpImplementation` with
``reference = True``, written in plain torch and correct on every platform.
Faster implementations of the same op register beside it. Entry-point names
are ``<op>.<implementation>``: ``rms_norm.torch`` (the reference),
``rms_norm.triton``.

Choosing an implementation (``weft.plugins.selection.choose_op``): among the enabled
implementations of the op that list the engine's platform (or ``"*"``) in
:attr:`OpImplementation.platforms` and whose :meth:`is_available` is true, the
highest :attr:`priority` wins; the reference has the lowest priority. The user
can force one in ``weft.toml``: ``[use.ops] rms_norm = "triton"``.

The conformance kit compares every implementation with the reference on the
reference's :meth:`example_inputs`, within :attr:`tolerance`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    from weft.contracts.platform import Platform


class OpImplementation(PluginBase):
    """One implementation of a named op. Instantiated once per engine: ``Impl(platform)``."""

    op: ClassVar[str]
    """The op's name: the part of the entry-point name before the dot."""
    platforms: ClassVar[frozenset[str]] = frozenset({"*"})
    """Platform names this implementation runs on; ``"*"`` means all."""
    priority: ClassVar[int] = 0
    """Higher wins among available implementations. References use -100."""
    reference: ClassVar[bool] = False
    """True for the op's defining torch implementation."""
    tolerance: ClassVar[tuple[float, float]] = (1e-5, 1e-5)
    """``(rtol, atol)`` against the reference, used by the conformance kit."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    @classmethod
    def runs_on(cls, platform_name: str) -> bool:
        return "*" in cls.platforms or platform_name in cls.platforms

    @classmethod
    def is_available(cls, platform: Platform) -> bool:
        """Whether this implementation can run now (a compiler present, a device capable)."""
        return True

    def declare(self, **shape: Any) -> None:
        """A layer that will call this op says, at construction, the static shape of its calls.

        Implementations that compile a kernel per shape record it here and
        register the kernel for warm-up (:mod:`weft.kernels.warmup`); the
        default ignores it. Each op documents the keys it passes.
        """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def example_inputs(cls, device: str) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
        """On the reference: ``(args, kwargs)`` cases covering the op's edge cases."""
        raise NotImplementedError(f"reference of op {cls.op!r} defines no example inputs")
