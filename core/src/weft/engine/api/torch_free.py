"""The API process imports no torch: the model's libraries live in the engine core's process.

``weft serve``'s API process needs transformers only for tokenizers, chat templates and configs, none of
which uses torch. But transformers imports torch whenever it is installed (``AutoTokenizer`` reaches
``configuration_utils``, which imports ``modeling_rope_utils``, which imports torch), and that alone puts
about a gigabyte of modules, and their objects, in a process that streams tokens.

:func:`transformers_without_torch` imports transformers while torch looks absent: transformers asks once
whether torch is installed (``is_torch_available``, cached for the process) and then runs as it does
where torch is not installed, its tokenizers unchanged. torch itself stays importable for anything that
needs it; ``tests/test_api_process_imports.py`` checks that a running server's API process never does.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def transformers_without_torch() -> None:
    """Import transformers in its torch-less mode, unless torch or transformers is loaded already (a process
    that uses torch itself: tests, ``LLM``) or transformers is not installed."""
    if "torch" in sys.modules or "transformers" in sys.modules or importlib.util.find_spec("transformers") is None:
        return
    # A None entry makes importlib.util.find_spec("torch") answer None (and `import torch` fail) until removed.
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers says "PyTorch was not found" once, as advice; here that is the intent, not a problem.
    advisory = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers.utils.import_utils

        transformers.utils.import_utils.is_torch_available()  # the answer is cached for the process
    finally:
        del sys.modules["torch"]
        if advisory is None:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advisory
