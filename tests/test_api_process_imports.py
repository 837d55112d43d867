"""The API process imports no torch: ``weft serve``'s server, :mod:`weft.engine.api` (the ``AsyncEngine``
the server drives), the process client and the weight loaders (which resolve the model there) load without
the model's libraries, which the engine-core process imports; and a real ``weft serve``'s API process, having
started, answered completions, a chat stream and constrained requests, and shut down, never loaded torch.

Each check runs in a fresh interpreter (this one has torch loaded already) and reads ``sys.modules``,
as ``python -X importtime -c "import weft.serve.app"`` would show it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

from conftest import free_port, make_tiny_model, start_weft_serve
from weft.contracts.structured_output import StructuredOutputsParams
from weft.engine.api import validation_process


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
        "weft.engine.api.validation_process",
        "weft.builtins.safetensors_loader",  # every installed loader is loaded to resolve the model
        "weft_gguf.loader",
        "weft_fastsafetensors.loader",
        "weft_weight_cache.loader",
    ],
)
def test_the_api_side_modules_import_no_torch(module):
    loaded = _modules_loaded(f"import {module}")
    assert "weft" in loaded
    assert "torch" not in loaded, f"importing {module} loads torch"


def test_the_check_sees_torch_where_the_core_imports_it():
    """The check is not blind: the engine core's modules do load torch."""
    assert "torch" in _modules_loaded("import weft.engine.core.engine_core, weft.engine.core.structured_output")


PROBE = """
import importlib.abc, json, os, sys, traceback

REPORT = sys.argv.pop(1)
torch_imported_from = []


class WatchTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "_find_and_load":
            frame = frame.f_back
        if name == "torch" and frame is not None and not torch_imported_from:  # an import, not a find_spec probe
            torch_imported_from.append("".join(traceback.format_stack()))
        return None  # the import goes on as usual


sys.meta_path.insert(0, WatchTorch())


def report():
    with open(REPORT, "w") as file:
        json.dump({"modules": sorted(sys.modules), "torch_imported_from": torch_imported_from}, file)


exit_now = os._exit


def exit_reporting(status):  # weft serve ends with os._exit, past atexit
    report()
    exit_now(status)


os._exit = exit_reporting
from weft.cli import main

status = main(sys.argv[1:])
report()
sys.exit(status)
"""
"""Runs the CLI (``python -c PROBE REPORT serve ...``) and, as the process exits, writes the modules it loaded and
where torch was first imported to REPORT. Spawned processes (the engine core, the validation worker) do not run it."""


def test_the_probe_sees_torch_imported_and_where(tmp_path):
    """The probe is not blind: a command that imports torch (``weft generate``'s path, here ``weft.runner``)
    is reported with the line that imported it, past ``os._exit``."""
    code = "import weft.runner.model_runner, os; os._exit(0)"
    probe = PROBE.replace("from weft.cli import main", f"{code}\nfrom weft.cli import main")
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-c", probe, str(report)], check=True, timeout=120)
    seen = json.loads(report.read_text())
    assert "torch" in seen["modules"]
    assert "weft/runner/" in seen["torch_imported_from"][0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer_files):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", "llama", tokenizer_files)


def test_a_running_servers_api_process_never_imports_torch(tiny_model, tmp_path):
    """Start-up (resolving the model with every installed loader, the tokenizer, the app), a completion, a streamed
    chat (its template), a JSON-schema constraint and one the backend refuses (a 400 with xgrammar's reason,
    checked in the validation worker), and a graceful shutdown: the API process never loads torch."""
    report = tmp_path / "modules.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("WEFT_")}
    port = free_port()
    args = ["--model", str(tiny_model), "--set", "engine.num_kv_blocks=512"]
    server, log = start_weft_serve(args, port, env, launcher=("-c", PROBE, str(report)))
    url = f"http://127.0.0.1:{port}/v1"
    model = tiny_model.name
    try:
        with httpx.Client(timeout=120) as http:
            reply = http.post(f"{url}/completions", json={"model": model, "prompt": "hello", "max_tokens": 4})
            assert reply.status_code == 200, reply.text
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            with http.stream("POST", f"{url}/chat/completions", json={**chat, "stream": True}) as stream:
                assert stream.status_code == 200
                assert "data: [DONE]" in list(stream.iter_lines())
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
            response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
            constrained = http.post(f"{url}/chat/completions", json={**chat, "response_format": response_format})
            assert constrained.status_code == 200, constrained.text
            refused = http.post(
                f"{url}/completions",
                json={"model": model, "prompt": "hello", "max_tokens": 4, "structured_outputs": {"regex": "a("}},
            )
            assert refused.status_code == 400, refused.text
            assert "xgrammar cannot compile it" in refused.json()["error"]["message"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            pytest.fail("the server did not stop on SIGINT:\n" + "".join(log))
    assert server.returncode == 0, "".join(log)
    seen = json.loads(report.read_text())
    assert "transformers" in seen["modules"] and "weft_xgrammar" in seen["modules"]  # the check sees the real work
    assert "torch" not in seen["modules"], "the API process imported torch:\n" + seen["torch_imported_from"][0]
    assert "xgrammar" not in seen["modules"]  # the constraint was checked in the validation worker


def test_the_validation_worker_answers_refuses_restarts_and_stops(monkeypatch):
    """The worker path (this process has torch, so it is forced): a constraint passes, a bad one is the backend's
    ValueError, a killed worker is one RuntimeError and then a fresh worker, and close() ends the worker."""
    from weft_xgrammar.backend import XgrammarBackend

    monkeypatch.setattr(validation_process, "_validates_in_place", lambda: False)
    validator = validation_process.ConstraintValidator()
    try:
        validator.validate(XgrammarBackend, StructuredOutputsParams(regex="[0-9]+"))
        with pytest.raises(ValueError, match="structured_outputs.regex: xgrammar cannot compile it"):
            validator.validate(XgrammarBackend, StructuredOutputsParams(regex="a("))
        first = validator._process
        first.kill()
        first.join()
        with pytest.raises(RuntimeError, match="validation process died"):
            validator.validate(XgrammarBackend, StructuredOutputsParams(regex="[0-9]+"))
        validator.validate(XgrammarBackend, StructuredOutputsParams(choice=("yes", "no")))
        second = validator._process
        assert second is not first and second.is_alive()
    finally:
        validator.close()
    assert not second.is_alive()
    with pytest.raises(RuntimeError, match="shutting down"):
        validator.validate(XgrammarBackend, StructuredOutputsParams(regex="[0-9]+"))
