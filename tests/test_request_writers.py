"""A request's progress and status have one writer: ``Scheduler.update_from_output``. Read with ast.

The engine core's :class:`~weft.engine.core.request.Request` carries what the steps produced: the tokens
computed (``num_computed_tokens``) and served from a cache (``num_cached_tokens``), the output tokens
(``append_token``, which keeps ``output_token_ids`` and ``all_token_ids`` in step) and how it ended
(``status``, ``stop_reason``). What the scheduler decides before a step's output arrives (tokens in
flight, admission, preemption) is its own bookkeeping, never a write to those fields.

Every write of those attribute names in core and in the plugins counts, whatever the object: an
assignment (plain, augmented, annotated, in a tuple), a call of ``append_token``, or a call that
changes ``output_token_ids`` / ``all_token_ids`` in place. :data:`WRITERS` lists where the engine's
requests are written; :data:`OTHER_STATE` lists writes of the same names to other objects, each
with what the object is.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "core" / "src", *sorted(ROOT.glob("plugins/*/src")), *sorted(ROOT.glob("plugins-*/src"))]

FIELDS = frozenset({"num_computed_tokens", "num_cached_tokens", "status", "stop_reason"})
TOKEN_LISTS = frozenset({"output_token_ids", "all_token_ids"})
LIST_MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "__setitem__", "__delitem__"})
APPEND_TOKEN = "append_token()"

EVERYTHING = FIELDS | TOKEN_LISTS | {APPEND_TOKEN}
WRITERS = {
    ("weft.engine.core.scheduler_state", "SchedulerState.update_from_output"): FIELDS | {APPEND_TOKEN},
    ("weft.engine.core.scheduler_state", "SchedulerState.finish"): frozenset({"status"}),
    # update_from_output's own helper: a row's tokens (several under speculative decoding) through the stop rules.
    ("weft.engine.core.request_output", "take_tokens"): frozenset({APPEND_TOKEN, "status", "stop_reason"}),
    ("weft.engine.core.request", "Request.__init__"): EVERYTHING,
    ("weft.engine.core.request", "Request.append_token"): TOKEN_LISTS,
}
"""(module, function) -> what it may write of the engine's requests."""

OTHER_STATE = {
    ("weft.runner.rejection_sampler", "VerifiedBatch.__init__", "status"): (
        "a verified batch's per-request status tensor (accepted, failed), which the runner reads"
    ),
    ("weft.runner.request_state", "RequestState.__init__", "num_computed_tokens"): "the worker's own copy of a request",
    ("weft.runner.model_runner", "ModelRunner._update_requests", "num_computed_tokens"): (
        "the worker's copy, updated from the step's CachedRequest"
    ),
    ("weft.runner.model_runner", "ModelRunner._execute", "num_computed_tokens"): (
        "the worker's copy, moved past the step's scheduled tokens"
    ),
    ("weft.runner.model_runner", "ModelRunner.finish_step", "num_computed_tokens"): (
        "the worker's copy, moved back over the step's rejected proposals"
    ),
    ("weft.builtins.draft_speculator", "_Row.__init__", "num_computed_tokens"): (
        "the draft speculator's view of a request for its own forward"
    ),
    ("weft_dsv4.mtp", "_Row.__init__", "num_computed_tokens"): (
        "the mtp speculator's view of a request's MTP entries for its own forward"
    ),
    (
        "weft.engine.api.output_processor",
        "RequestOutputState.__init__",
        "output_token_ids",
    ): "the API side's request state",
    ("weft.engine.api.output_processor", "RequestOutputState.__init__", "stop_reason"): "the API side's request state",
    (
        "weft.engine.api.output_processor",
        "RequestOutputState.__init__",
        "num_cached_tokens",
    ): "the API side's request state",
    (
        "weft.engine.api.output_processor",
        "OutputProcessor.process",
        "num_cached_tokens",
    ): "the API side's copy of the core's count",
    ("weft.engine.api.output_processor", "OutputProcessor._append", "stop_reason"): "the API side's request state",
    ("weft.engine.api.output_processor", "OutputProcessor._append", "output_token_ids"): "the API side's request state",
    (
        "weft.engine.api.output_processor",
        "OutputProcessor._check_stop_strings",
        "stop_reason",
    ): "the API side's stop strings",
    ("weft.runner.sampler", "SampledBatch.__init__", "status"): "each sampled row's outcome (a device tensor)",
    ("weft.serve.body", "HTTPError.__init__", "status"): "an HTTP status code",
    ("weft_disagg.pd", "ProxyError.__init__", "status"): "an HTTP status code",
}
"""(module, function, field) -> what the object written is, when it is not the engine's request."""


class Write(NamedTuple):
    module: str
    function: str
    """The enclosing class and function names, dotted (``<module>`` at module level)."""
    field: str
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} ({self.function}) writes {self.field}"


def module_name(path: Path, source: Path) -> str:
    parts = path.relative_to(source).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def writes_in(module: str, text: str) -> list[Write]:
    found: list[Write] = []

    def add(scope: list[str], field: str, node: ast.AST) -> None:
        found.append(Write(module, ".".join(scope) or "<module>", field, node.lineno))  # type: ignore[attr-defined]

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = [*scope, node.name]
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and node.attr in EVERYTHING:
            add(scope, node.attr, node)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Attribute) and node.value.attr in TOKEN_LISTS:
                add(scope, node.value.attr, node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "append_token":
                add(scope, APPEND_TOKEN, node)
            receiver = node.func.value
            if node.func.attr in LIST_MUTATORS and isinstance(receiver, ast.Attribute) and receiver.attr in TOKEN_LISTS:
                add(scope, receiver.attr, node)
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(text), [])
    return found


def scan(sources: list[Path]) -> list[Write]:
    found = []
    for source in sources:
        for path in sorted(source.rglob("*.py")):
            found += writes_in(module_name(path, source), path.read_text())
    return found


def stray_writes(writes: list[Write]) -> list[str]:
    return [
        f"  {write}"
        for write in writes
        if write.field not in WRITERS.get((write.module, write.function), ())
        and (write.module, write.function, write.field) not in OTHER_STATE
    ]


def test_only_update_from_output_and_finish_write_request_progress_and_status():
    found = stray_writes(scan(SOURCES))
    assert not found, (
        "request progress and status written outside Scheduler.update_from_output (and finish, for the API's "
        "aborts): keep what the scheduler plans in its own bookkeeping, and let update_from_output write what "
        "a step produced (or, for another object with the same field name, add it to OTHER_STATE):\n" + "\n".join(found)
    )


def test_every_allowed_write_still_exists():
    writes = scan(SOURCES)
    seen = {(write.module, write.function, write.field) for write in writes}
    for (module, function), fields in WRITERS.items():
        assert any((module, function, field) in seen for field in fields), (
            f"WRITERS allows {module}.{function}, which writes none of {sorted(fields)} any more; remove the entry"
        )
    for key, what in OTHER_STATE.items():
        assert key in seen, f"OTHER_STATE allows {key} ({what}), which no longer exists; remove the entry"


def test_the_scan_finds_every_kind_of_write():
    text = """
class SchedulerState:
    def schedule(self, request):
        request.num_computed_tokens += 4
        request.status, other = None, 1
        request.output_token_ids.append(3)
        request.all_token_ids[-1:] = [3]
    def update_from_output(self, request):
        request.num_computed_tokens = 5
        request.append_token(7)

def plan(request):
    request.num_cached_tokens: int = 2
    request.append_token(7)
    del request.stop_reason
"""
    found = stray_writes(writes_in("weft.engine.core.scheduler_state", text))
    assert found == [
        "  weft.engine.core.scheduler_state:4 (SchedulerState.schedule) writes num_computed_tokens",
        "  weft.engine.core.scheduler_state:5 (SchedulerState.schedule) writes status",
        "  weft.engine.core.scheduler_state:6 (SchedulerState.schedule) writes output_token_ids",
        "  weft.engine.core.scheduler_state:7 (SchedulerState.schedule) writes all_token_ids",
        "  weft.engine.core.scheduler_state:13 (plan) writes num_cached_tokens",
        "  weft.engine.core.scheduler_state:14 (plan) writes append_token()",
        "  weft.engine.core.scheduler_state:15 (plan) writes stop_reason",
    ]
