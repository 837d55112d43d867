"""Zero JIT at runtime: every kernel variant a server will launch is compiled before it serves.

A JIT-compiled kernel (Triton, for one) specialises on a few values: dtypes,
head sizes, block sizes, whether a mask is present. Weft makes those values a
frozen, hashable :class:`CompileKey` and gives each kernel **one** function,
:meth:`Kernel.dispatch`, that maps launch inputs to the key. Warm-up and runtime
both call it, so they cannot disagree about which variant a launch needs.

* A kernel declares the inputs it will see as an :class:`InputSpace`: integer
  ranges, choices, zipped inputs that vary together, and filters. Warm-up
  enumerates the space, maps every point through ``dispatch`` (inputs the key
  does not depend on collapse) and compiles each distinct key once.
* While a model is built, :func:`collecting` makes a :class:`KernelRegistry`
  active; layers call :func:`register` for the kernels they will launch.
  Registering the same kernel from many layers collapses to one entry, and a
  kernel whose backend is unusable here is not registered at all.
* :func:`compile_many` compiles missing keys: de-duplicated in order, already
  compiled ones skipped, one at a time below two, else on ``min(4, missing)``
  threads, results written back with a strict zip.
* At runtime :meth:`Kernel.__call__` finds the compiled variant; a miss goes to
  the :class:`RuntimeMonitor`, which warns (and compiles) or refuses, by mode.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Literal

import msgspec

logger = logging.getLogger("weft.kernels")


class CompileKey(msgspec.Struct, frozen=True):
    """Base of a kernel's compile key: only the values its compiled code specialises on."""


# Input spaces.


class InputSpace:
    """Launch inputs a kernel will see, enumerated as dicts of name -> value."""

    def points(self) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def __mul__(self, other: InputSpace) -> InputSpace:
        return Product(self, other)

    def where(self, predicate: Callable[..., bool]) -> InputSpace:
        """Only the points for which ``predicate(**point)`` is true."""
        return Filtered(self, predicate)


class IntRange(InputSpace):
    """``name`` takes every integer of ``range(start, stop, step)``."""

    def __init__(self, name: str, start: int, stop: int, step: int = 1) -> None:
        self.name, self.values = name, range(start, stop, step)

    def points(self) -> Iterator[dict[str, Any]]:
        return ({self.name: value} for value in self.values)


class Choice(InputSpace):
    """``name`` takes each of ``values``."""

    def __init__(self, name: str, values: Iterable[Any]) -> None:
        self.name, self.values = name, tuple(values)

    def points(self) -> Iterator[dict[str, Any]]:
        return ({self.name: value} for value in self.values)


class Zipped(InputSpace):
    """Several inputs that vary together: ``Zipped(head_dim=[64, 128], block=[64, 32])``."""

    def __init__(self, **columns: Sequence[Any]) -> None:
        lengths = {len(values) for values in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"Zipped inputs need columns of one length, got {sorted(lengths)}")
        self.columns = columns

    def points(self) -> Iterator[dict[str, Any]]:
        names = list(self.columns)
        return (dict(zip(names, row, strict=False)) for row in zip(*self.columns.values(), strict=False))


class Product(InputSpace):
    def __init__(self, *spaces: InputSpace) -> None:
        self.spaces = spaces

    def points(self) -> Iterator[dict[str, Any]]:
        for combination in itertools.product(*(list(space.points()) for space in self.spaces)):
            point: dict[str, Any] = {}
            for part in combination:
                point.update(part)
            yield point


class Filtered(InputSpace):
    def __init__(self, space: InputSpace, predicate: Callable[..., bool]) -> None:
        self.space, self.predicate = space, predicate

    def points(self) -> Iterator[dict[str, Any]]:
        return (point for point in self.space.points() if _call_with(self.predicate, point))


def _call_with(function: Callable[..., Any], inputs: dict[str, Any]) -> Any:
    """Call ``function`` with the inputs it names (others are ignored), or all if it takes ``**kwargs``."""
    names = _parameter_names(getattr(function, "__func__", function))
    if names is None:
        return function(**inputs)
    return function(**{name: value for name, value in inputs.items() if name in names})


@functools.lru_cache(maxsize=256)
def _parameter_names(function: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names ``function`` accepts; None when it takes ``**kwargs`` (runs once per function)."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


# Kernels.


class RuntimeMonitor:
    """What happens when a launch needs a variant warm-up did not compile.

    ``warn``: log it, compile it, go on. ``error``: raise, so tests and strict
    deployments find the gap. Misses are counted either way.
    """

    def __init__(self, mode: Literal["warn", "error"] = "warn") -> None:
        if mode not in ("warn", "error"):
            raise ValueError(f"monitor mode {mode!r}: expected 'warn' or 'error'")
        self.mode = mode
        self.misses: list[tuple[str, CompileKey]] = []

    def miss(self, kernel: Kernel, key: CompileKey) -> None:
        self.misses.append((kernel.name, key))
        message = f"kernel {kernel.name!r} compiled at runtime for {key!r}: warm-up did not cover it"
        if self.mode == "error":
            raise RuntimeError(message + "; declare it in the kernel's input space")
        logger.warning(message)


class Kernel(ABC):
    """A JIT kernel with a compile key, one dispatch, a declared input space and a compiled-variant cache."""

    name: ClassVar[str]

    def __init__(self, monitor: RuntimeMonitor | None = None) -> None:
        self.monitor = monitor or RuntimeMonitor()
        self.compiled: dict[CompileKey, Any] = {}
        self._lock = threading.Lock()

    @abstractmethod
    def dispatch(self, **inputs: Any) -> CompileKey:
        """The compile key a launch with ``inputs`` needs. Used by warm-up and runtime alike."""

    @abstractmethod
    def compile(self, key: CompileKey) -> Any:
        """Build the variant for ``key`` (compile-only where the backend allows); returns what :meth:`launch` runs."""

    @abstractmethod
    def launch(self, compiled: Any, **inputs: Any) -> Any:
        """Run a compiled variant."""

    def input_space(self) -> InputSpace | None:
        """The inputs this kernel will see; None if it cannot say (then it is not warmed up)."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """Whether the backend works here (a GPU, a compiler); unavailable kernels are not registered."""
        return True

    def warmup_keys(self) -> list[CompileKey]:
        space = self.input_space()
        if space is None:
            return []
        return list(dict.fromkeys(_call_with(self.dispatch, point) for point in space.points()))

    def __call__(self, **inputs: Any) -> Any:
        key = _call_with(self.dispatch, inputs)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.monitor.miss(self, key)
            compile_many(self, [key])
            compiled = self.compiled[key]
        return self.launch(compiled, **inputs)


def compile_many(kernel: Kernel, keys: Iterable[CompileKey]) -> list[CompileKey]:
    """Compile the keys ``kernel`` lacks; returns the ones compiled now, in order."""
    wanted = list(dict.fromkeys(keys))
    missing = [key for key in wanted if key not in kernel.compiled]
    if not missing:
        return []
    if len(missing) < 2:
        results = [kernel.compile(key) for key in missing]
    else:
        with ThreadPoolExecutor(max_workers=min(4, len(missing)), thread_name_prefix=f"compile-{kernel.name}") as pool:
            results = list(pool.map(kernel.compile, missing))
    with kernel._lock:
        for key, result in zip(missing, results, strict=True):
            kernel.compiled[key] = result
    return missing


# The registry active while a model is built.


class KernelRegistry:
    """Kernels a model will launch, gathered while it is built; :meth:`warm_up` compiles them.

    With a ``monitor``, every kernel added reports its runtime misses to it (the
    engine passes one in the mode ``engine.runtime_jit`` names).
    """

    def __init__(self, monitor: RuntimeMonitor | None = None) -> None:
        self.kernels: dict[str, Kernel] = {}
        self.monitor = monitor

    def add(self, kernel: Kernel) -> None:
        if not kernel.is_available():
            return
        existing = self.kernels.get(kernel.name)
        if existing is not None and existing is not kernel:
            raise ValueError(f"two different kernels are registered as {kernel.name!r}")
        self.kernels[kernel.name] = kernel
        if self.monitor is not None:
            kernel.monitor = self.monitor

    def warm_up(self) -> dict[str, int]:
        """Compile every declared variant; returns how many each kernel compiled now."""
        return {name: len(compile_many(kernel, kernel.warmup_keys())) for name, kernel in self.kernels.items()}


_active: contextvars.ContextVar[KernelRegistry | None] = contextvars.ContextVar("weft_kernel_registry", default=None)


@contextlib.contextmanager
def collecting(registry: KernelRegistry | None = None) -> Iterator[KernelRegistry]:
    """Make ``registry`` (a new one by default) the target of :func:`register` inside the block."""
    registry = registry if registry is not None else KernelRegistry()
    token = _active.set(registry)
    try:
        yield registry
    finally:
        _active.reset(token)


def register(kernel: Kernel) -> Kernel:
    """Record that the model being built launches ``kernel``; a no-op outside :func:`collecting`."""
    registry = _active.get()
    if registry is not None:
        registry.add(kernel)
    return kernel
