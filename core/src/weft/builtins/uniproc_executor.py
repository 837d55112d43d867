"""The ``uniproc`` executor: one worker in the engine core's own process.

The step still crosses to the worker as msgpack bytes, as it would to a worker
in another process: what the worker reads is exactly what the scheduler sent,
whatever the scheduler changes afterwards. A step's grammar bitmask is handed
over as it is: its rows are already bytes and its request ids a list made for
it, which nothing changes afterwards, so a round trip would only copy them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from weft.contracts.executor import (
    Executor,
    GrammarOutput,
    SchedulerOutput,
    StepHandle,
    WorkerInfo,
    decode_scheduler_output,
    encode_step,
)


class UniprocExecutor(Executor):
    name: ClassVar[str] = "uniproc"
    supports_async_output: ClassVar[bool] = True

    def __init__(self, options: Any, config: Any, registry: Any = None) -> None:
        super().__init__(options, config, registry)
        from weft.runner.worker import Worker

        self.worker = Worker(config, registry)
        self.launch_ahead = self.worker.device.type != "cpu"  # a CPU worker's tokens are on the host as it samples
        self._closed = False

    def load_model(self) -> WorkerInfo:
        return self.worker.load_model()

    def initialize_kv_cache(self, num_blocks: list[int]) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, step: SchedulerOutput) -> StepHandle | None:
        return self.worker.execute_model(decode_scheduler_output(encode_step(step)))

    def sample_tokens(self, grammar: GrammarOutput) -> StepHandle:
        return self.worker.sample_tokens(grammar)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.worker.shutdown()
