"""What a newcomer reads while ``weft serve`` or ``weft generate`` starts: one line per step that can take
seconds (loading or converting the weights, sizing the KV cache, warming up), a progress bar for long
loops, and a summary once the model is ready.

Everything goes through the ``weft.progress`` logger, which writes ``weft: <message>`` lines to stderr
on its own (not through the root logger's ``INFO name:`` format); library users silence it with
``logging.getLogger("weft.progress").setLevel(logging.WARNING)``. Internal detail (chosen ops, kernel
counts, effective settings) is debug logging of the modules that own it. Of a several-worker engine only
rank 0 reports the workers' steps, so each line is printed once.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar


class _StderrHandler(logging.StreamHandler):
    """Writes to what ``sys.stderr`` is at the time of each line (a redirected stream, a test's capture)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr


logger = logging.getLogger("weft.progress")
if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("weft: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

T = TypeVar("T")

BAR_WIDTH = 30


def report(message: str, *args: Any) -> None:
    """One line about what is being done now (``message % args``)."""
    logger.info(message, *args)


def bar(items: Iterable[T], total: int, label: str, unit: str) -> Iterator[T]:
    """``items``, drawing ``weft: <label> [#####.....] i/total <unit>`` in place on a terminal while they are
    consumed; elsewhere (a log file, a pipe) ``weft: <label>: <total> <unit>`` once, without the bar."""
    stream = sys.stderr
    drawing = logger.isEnabledFor(logging.INFO) and stream.isatty()
    if not drawing:
        report("%s: %d %s", label, total, unit)
        yield from items
        return
    for index, item in enumerate(items, start=1):
        yield item
        done = BAR_WIDTH * index // max(total, 1)
        stream.write(f"\rweft: {label} [{'#' * done}{'.' * (BAR_WIDTH - done)}] {index}/{total} {unit}")
        stream.flush()
    stream.write("\n")


def human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def summary_lines(facts: Mapping[str, Any], seconds: float, url: str | None = None) -> list[str]:
    """The startup summary: model, platform (on the CPU, its GEMM instruction sets and GEMM dtype), dtype (and
    the weights' source format), KV capacity, and the URL when serving. ``facts``: :meth:`weft.engine.core.engine_core.EngineCore.describe`."""
    blocks = facts["num_kv_blocks"]
    capacity = facts.get("kv_capacity_tokens")
    kv = f"{capacity:,} tokens" if capacity else f"{sum(blocks):,} blocks"
    kv += (
        f" ({', '.join(f'{count:,}' for count in blocks)} blocks of {facts['block_size']}); "
        f"up to {facts['max_model_len']:,} tokens per request"
    )
    lines = [
        f"ready in {seconds:.1f} s",
        f"  model     {facts['model']} ({facts['architecture']}, {facts['weights_format']} file "
        f"{facts['weights_file']})",
        f"  platform  {facts['platform']}",
        *([f"  CPU       {facts['cpu_isa']}"] if facts.get("cpu_isa") else []),
        _dtype_line(facts),
        f"  KV cache  {kv}",
    ]
    defaults = facts.get("sampling_defaults")
    if defaults:
        lines.append(
            f"  sampling  {', '.join(f'{key}={value}' for key, value in defaults.items())} "
            f"(the model's defaults; a request's own values win)"
        )
    if url is not None:
        lines.append(f"  serving   {url}")
    return lines


def report_summary(facts: Mapping[str, Any], started: float, url: str | None = None) -> None:
    """Print :func:`summary_lines` (``started``: the ``time.monotonic()`` the start began at)."""
    for line in summary_lines(facts, time.monotonic() - started, url):
        report("%s", line)


def _dtype_line(facts: Mapping[str, Any]) -> str:
    """The weights' numerics: quantized by a ``weft.quantization`` method, or dense in ``dtype``."""
    quantization = facts.get("quantization", "none")
    if quantization != "none":
        return (
            f"  weights   {quantization} (the {facts['weights_format']} file's blocks kept quantized, the rest "
            f"{facts['dtype']}; weft config show lists each format)"
        )
    converted = facts["weights_format"] != "safetensors"
    return f"  dtype     {facts['dtype']}" + (
        f" (converted from the {facts['weights_format']} file's weights)" if converted else ""
    )
