"""Hook implementations: count finished requests by finish reason."""

from collections import Counter

from weft.contracts.hooks import hookimpl

finished = Counter()


@hookimpl
def weft_request_finished(finish_reason: str) -> None:
    finished[finish_reason] += 1
