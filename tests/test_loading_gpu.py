"""On a GPU: fastsafetensors reads what the plain loader reads (GPU-direct or bounce buffer), and a weight-cache
daemon hands an engine process its weights over CUDA IPC with output identical to a disk start."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_files) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpu-loading") / "model", "llama", tokenizer_files)


def test_fastsafetensors_on_the_gpu_loads_the_plain_loaders_tensors(checkpoint):
    from weft.builtins.safetensors_loader import SafetensorsLoader
    from weft.contracts.loader import LoadConfig
    from weft_fastsafetensors.loader import FastSafetensorsLoader

    loader = FastSafetensorsLoader.for_load(None, LoadConfig(loader="fastsafetensors", device="cuda:0"))
    source = loader.resolve(str(checkpoint))
    loaded = {name: tensor.clone() for name, tensor in loader.iter_weights(source, "bfloat16")}
    plain = dict(SafetensorsLoader().iter_weights(source, "bfloat16"))
    assert loaded.keys() == plain.keys()
    for name, tensor in plain.items():
        assert loaded[name].device.type == "cuda" and torch.equal(loaded[name].cpu(), tensor), name


def generate(checkpoint: Path, socket_dir: Path, *extra: str) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "weft.cli",
            "generate",
            "The weather today",
            "--model",
            str(checkpoint),
            "--max-tokens",
            "16",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--set",
            f'plugins.weight-cache.socket_dir="{socket_dir}"',
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return {
        "tokens": json.loads(result.stdout.strip().splitlines()[-1])[0]["outputs"][0]["token_ids"],
        "log": result.stderr,
    }


def test_a_daemon_serves_an_engine_over_cuda_ipc(checkpoint):
    socket_dir = Path(tempfile.mkdtemp(prefix="wcg", dir="/tmp"))
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weft.cli",
            "weights",
            "serve",
            "--model",
            str(checkpoint),
            "--socket-dir",
            str(socket_dir),
            "--devices",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = daemon.stdout.readline()
        assert line.startswith("weft weights: serving") and " on cuda-" in line, line + daemon.stderr.read()
        from_disk = generate(checkpoint, socket_dir)
        mapped = generate(checkpoint, socket_dir, "--loader", "weight-cache")
        assert "loading from disk" not in mapped["log"], mapped["log"]
        assert mapped["tokens"] == from_disk["tokens"]
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, log = daemon.communicate(timeout=120)
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert "lease" in log
