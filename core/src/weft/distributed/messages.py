"""What the engine core and the worker processes say to each other (msgpack over ZMQ).

The engine publishes :data:`ToWorkers` on one channel every worker subscribes to
(a step is encoded once, whatever the number of workers); workers and node
launchers push :data:`FromWorkers` back on another. Per step only the output
rank (the last stage's first tensor rank) answers.
"""

from __future__ import annotations

import msgspec

from weft.contracts.executor import GrammarOutput, ModelRunnerOutput, WorkerInfo


class LoadModel(msgspec.Struct, tag=True, array_like=True):
    pass


class InitializeKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: list[int]


class Execute(msgspec.Struct, tag=True, array_like=True):
    step: bytes
    """The :class:`~weft.contracts.executor.SchedulerOutput`, msgpack-encoded."""


class SampleTokens(msgspec.Struct, tag=True, array_like=True):
    """Sample the step the last :class:`Execute` left waiting for its structured-output bitmask."""

    grammar: GrammarOutput


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToWorkers = LoadModel | InitializeKVCache | Execute | SampleTokens | Shutdown


class Hello(msgspec.Struct, tag=True, array_like=True):
    rank: int
    pid: int
    host: str


class Loaded(msgspec.Struct, tag=True, array_like=True):
    rank: int
    info: WorkerInfo


class Initialized(msgspec.Struct, tag=True, array_like=True):
    rank: int


class StepDone(msgspec.Struct, tag=True, array_like=True):
    output: ModelRunnerOutput


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    """A worker's error (it exits after sending it), or a node launcher's report of a worker that died."""

    rank: int
    cause: str
    traceback: str = ""


class NodeAlive(msgspec.Struct, tag=True, array_like=True):
    """A node launcher's heartbeat: its workers run."""

    node_rank: int


FromWorkers = Hello | Loaded | Initialized | StepDone | WorkerFailed | NodeAlive
