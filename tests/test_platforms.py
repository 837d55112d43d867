"""Platform plugins: the conformance kit on every built-in platform, and the hardware probes on fake machines."""

from __future__ import annotations

from pathlib import Path

import pytest

from weft.contracts.platform import torch_has_library
from weft.testing import PlatformContract


class TestCpuPlatform(PlatformContract):
    plugin_name = "cpu"


class TestCudaPlatform(PlatformContract):
    plugin_name = "cuda"


class TestRocmPlatform(PlatformContract):
    plugin_name = "rocm"


class TestXpuPlatform(PlatformContract):
    plugin_name = "xpu"


def fake_file(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_nvidia_probe_reads_the_driver_files(tmp_path, monkeypatch):
    from weft_cuda.platform import probe_nvidia

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not probe_nvidia(tmp_path).available
    assert "no NVIDIA driver" in probe_nvidia(tmp_path).reason
    fake_file(tmp_path, "proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86\n")
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        fake_file(tmp_path, f"proc/driver/nvidia/gpus/{bus}/information", "Model: \t\t NVIDIA H200\nIRQ: 1\n")
    probe = probe_nvidia(tmp_path)
    assert probe.device_count == 2 and probe.details["gpus"] == "NVIDIA H200, NVIDIA H200"
    # With a CPU build of torch the probe must say so rather than claim the GPUs.
    if torch_has_library("libtorch_cuda.so"):
        assert probe.available and probe.priority == 100
    else:
        assert not probe.available and "no CUDA support" in probe.reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "no visible GPU" in probe_nvidia(tmp_path).reason
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    sandboxed = tmp_path / "sandboxed"
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        fake_file(sandboxed, f"dev/{name}", "")
    assert probe_nvidia(sandboxed).device_count == 2  # device files only, as under gVisor


def test_amd_probe_names_the_architecture(tmp_path, monkeypatch):
    from weft_rocm.platform import gfx_name, probe_amd

    for variable in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)
    assert gfx_name(90500) == "gfx950" and gfx_name(90402) == "gfx942" and gfx_name(110001) == "gfx1101"
    assert "no AMD GPU driver" in probe_amd(tmp_path).reason
    fake_file(tmp_path, "dev/kfd", "")
    fake_file(tmp_path, "sys/class/kfd/kfd/topology/nodes/0/properties", "cpu_cores_count 64\ngfx_target_version 0\n")
    fake_file(tmp_path, "sys/class/kfd/kfd/topology/nodes/1/properties", "simd_count 256\ngfx_target_version 90500\n")
    probe = probe_amd(tmp_path)
    assert probe.device_count == 1 and probe.details["architectures"] == "gfx950"
    assert probe.available if torch_has_library("libtorch_hip.so") else "no ROCm support" in probe.reason


def test_intel_probe_finds_intel_render_nodes(tmp_path, monkeypatch):
    from weft_xpu.platform import probe_intel

    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    fake_file(tmp_path, "sys/class/drm/renderD128/device/vendor", "0x10de\n")
    assert "no Intel GPU" in probe_intel(tmp_path).reason
    fake_file(tmp_path, "sys/class/drm/renderD129/device/vendor", "0x8086\n")
    fake_file(tmp_path, "sys/class/drm/renderD129/device/class", "0x038000\n")
    fake_file(tmp_path, "sys/class/drm/renderD129/device/device", "0x0bd5\n")
    probe = probe_intel(tmp_path)
    assert probe.device_count == 1 and probe.details["devices"] == "0x0bd5"
    assert probe.available if torch_has_library("libtorch_xpu.so") else "no XPU support" in probe.reason


@pytest.mark.parametrize(("value", "expected"), [(None, 4), ("", 0), ("-1", 0), ("0,2", 2), ("0,1,2,3,4,5", 4)])
def test_visible_device_count(monkeypatch, value, expected):
    from weft.contracts.platform import visible_device_count

    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_device_count(4, "CUDA_VISIBLE_DEVICES") == expected
