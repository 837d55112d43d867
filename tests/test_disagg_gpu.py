"""Prefill/decode disaggregation, VRAM to VRAM: a random Llama-3-8B-shape checkpoint served by a prefill
instance on GPU 0 and a decode instance on GPU 1 (both on GPU 0, each with 30% of its free memory, where the
machine has one) behind ``weft proxy pd``; greedy output through the
proxy equals the decode instance's alone, and every prompt token but the last arrives through NIXL
(``bench/pd.py --part check``, which also measures TTFT and bandwidth with other parts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

ROOT = Path(__file__).resolve().parent.parent


def test_llama3_8b_shape_output_through_the_proxy_equals_one_instance(tokenizer_files, tmp_path):
    pytest.importorskip("weft_nixl")
    pytest.importorskip("weft_disagg")
    gpus = ["--prefill-gpu", "0", "--decode-gpu", "1"]
    if torch.cuda.device_count() == 1:
        gpus = ["--prefill-gpu", "0", "--decode-gpu", "0", "--gpu-memory-utilization", "0.3"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "pd.py"),
            "--llama8b",
            "--tokenizer",
            str(tokenizer_files),
            *gpus,
            "--part",
            "check",
            "--check-prompts",
            "16",
            "--prompt",
            "2048",
            "--output",
            "32",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    print(result.stdout[-3000:], result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: 16/16 greedy outputs" in result.stdout
