"""The API process's modules import no torch: ``weft serve``'s server, :mod:`weft.engine.api` (the
``AsyncEngine`` the server drives) and the process client load without the model's libraries, which
the engine-core process imports.

Each check runs in a fresh interpreter (this one has torch loaded already) and reads ``sys.modules``,
as ``python -X importtime -c "import weft.serve.app"`` would show it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _modules_loaded(code: str, timeout: float = 120) -> set[str]:
    """The top-level packages ``code`` leaves in ``sys.modules``, run in a fresh interpreter."""
    script = (
        textwrap.dedent(code) + "\nimport sys\nprint(' '.join(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.parametrize(
    "module",
    [
        "weft.serve.app",
        "weft.entrypoints.serve",
        "weft.engine.api.async_engine",
        "weft.engine.api.llm_engine",
        "weft.engine.client",
        "weft.engine.messages",
        "weft.engine.core.core_process",  # the process client names its entry point
    ],
)
def test_the_api_side_modules_import_no_torch(module):
    loaded = _modules_loaded(f"import {module}")
    assert "weft" in loaded
    assert "torch" not in loaded, f"importing {module} loads torch"


def test_the_check_sees_torch_where_the_core_imports_it():
    """The check is not blind: the engine core's modules do load torch."""
    assert "torch" in _modules_loaded("import weft.engine.core.engine_core, weft.engine.core.structured_output")
