"""Platform plugins: the platform, attention and ops suites of the kit on every platform (each on its own
device where it finds one, skipped with the probe's reason where not), and the hardware probes on
fabricated /proc, /sys and /dev trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from weft.contracts.platform import torch_has_library
from weft.plugins import PluginRegistry
from weft.testing import AttentionContract, OpContract, PlatformContract

PLATFORMS = ("cpu", "cuda", "rocm", "xpu")
OP_IMPLEMENTATIONS = PluginRegistry().names("ops")  # entry-point metadata only: nothing is imported


def _suites() -> dict[str, type]:
    """One platform suite, one attention suite (its default backend) and one ops suite per op
    implementation, for every platform; a GPU runs them in its default half-precision dtype."""
    suites: dict[str, type] = {}
    registry = PluginRegistry()
    for platform in PLATFORMS:
        title = platform.capitalize()
        gpu = platform != "cpu"
        mark = pytest.mark.gpu if gpu else (lambda suite: suite)  # `-m gpu` selects them on a GPU machine
        platform_class = registry.load("platform", platform)
        suites[f"Test{title}Platform"] = mark(
            type(f"Test{title}Platform", (PlatformContract,), {"plugin_name": platform})
        )
        suites[f"Test{title}Attention"] = mark(
            type(
                f"Test{title}Attention",
                (AttentionContract,),
                {
                    "plugin_name": platform_class.default_attention,
                    "platform": platform,
                    "dtype": "bfloat16" if gpu else "float32",
                    "tolerance": (2e-2, 2e-2) if gpu else (1e-4, 1e-4),
                },
            )
        )
        for name in OP_IMPLEMENTATIONS:
            class_name = f"Test{title}Op_{name.replace('.', '_')}"
            suites[class_name] = mark(type(class_name, (OpContract,), {"plugin_name": name, "platform": platform}))
    return suites


globals().update(_suites())


def fake_file(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_nvidia_probe_reads_the_driver_files(tmp_path, monkeypatch):
    from weft_cuda.platform import CudaPlatform

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert not CudaPlatform.probe_root(tmp_path).available
    assert (
        "no NVIDIA GPU driver (/proc/driver/nvidia/version and /dev/nvidiactl are absent)"
        == CudaPlatform.probe_root(tmp_path).reason
    )
    fake_file(tmp_path, "proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86\n")
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        fake_file(tmp_path, f"proc/driver/nvidia/gpus/{bus}/information", "Model: \t\t NVIDIA H200\nIRQ: 1\n")
    probe = CudaPlatform.probe_root(tmp_path)
    assert probe.device_count == 2 and probe.details["gpus"] == "NVIDIA H200, NVIDIA H200"
    assert probe.details["driver"].startswith("NVRM version")
    # With a CPU build of torch the probe must say so rather than claim the GPUs.
    if torch_has_library("libtorch_cuda.so"):
        assert probe.available and probe.priority == 100
    else:
        assert not probe.available and "no CUDA support; install a CUDA build of torch" in probe.reason
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert (
        CudaPlatform.probe_root(tmp_path).reason
        == "NVIDIA driver present but no visible GPU (2 hidden by CUDA_VISIBLE_DEVICES)"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert CudaPlatform.probe_root(tmp_path).device_count == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    sandboxed = tmp_path / "sandboxed"
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm", "nvidia-modeset"):
        fake_file(sandboxed, f"dev/{name}", "")
    probe = CudaPlatform.probe_root(sandboxed)
    assert probe.device_count == 2 and probe.details == {
        "driver": "unknown",
        "gpus": "nvidia0, nvidia1",
    }  # as under gVisor


def test_amd_probe_names_the_architectures_in_node_order(tmp_path, monkeypatch):
    from weft_rocm.platform import RocmPlatform, gfx_name

    for variable in RocmPlatform.visibility_variables:
        monkeypatch.delenv(variable, raising=False)
    assert gfx_name(90500) == "gfx950" and gfx_name(90402) == "gfx942" and gfx_name(110001) == "gfx1101"
    assert RocmPlatform.probe_root(tmp_path).reason == "no AMD GPU driver (/dev/kfd is absent)"
    fake_file(tmp_path, "dev/kfd", "")
    assert RocmPlatform.probe_root(tmp_path).reason == "AMD driver present but no visible GPU"  # amdkfd, no GPU node
    fake_file(tmp_path, "sys/class/kfd/kfd/topology/nodes/0/properties", "cpu_cores_count 64\ngfx_target_version 0\n")
    for node in range(1, 11):  # node 10 sorts after node 9, not after node 1
        version = 90402 if node == 10 else 90500
        fake_file(
            tmp_path,
            f"sys/class/kfd/kfd/topology/nodes/{node}/properties",
            f"simd_count 256\ngfx_target_version {version}\n",
        )
    probe = RocmPlatform.probe_root(tmp_path)
    assert probe.device_count == 10 and probe.details["architectures"] == ", ".join(["gfx950"] * 9 + ["gfx942"])
    assert probe.available if torch_has_library("libtorch_hip.so") else "no ROCm support" in probe.reason
    # HIP_VISIBLE_DEVICES is read first, then ROCR_VISIBLE_DEVICES, then CUDA_VISIBLE_DEVICES.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0")
    assert RocmPlatform.probe_root(tmp_path).device_count == 1
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "-1")
    assert (
        "no visible GPU (10 hidden by HIP_VISIBLE_DEVICES or ROCR_VISIBLE_DEVICES"
        in RocmPlatform.probe_root(tmp_path).reason
    )


def test_intel_probe_finds_intel_display_class_render_nodes(tmp_path, monkeypatch):
    from weft_xpu.platform import XpuPlatform

    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    fake_file(tmp_path, "sys/class/drm/renderD128/device/vendor", "0x10de\n")
    assert XpuPlatform.probe_root(tmp_path).reason == "no Intel GPU driver (no Intel renderD* device in /sys/class/drm)"
    fake_file(tmp_path, "sys/class/drm/renderD129/device/vendor", "0x8086\n")
    fake_file(tmp_path, "sys/class/drm/renderD129/device/class", "0x038000\n")
    fake_file(tmp_path, "sys/class/drm/renderD129/device/device", "0x0bd5\n")
    fake_file(tmp_path, "sys/class/drm/renderD130/device/vendor", "0x8086\n")  # an Intel NPU: not a display class
    fake_file(tmp_path, "sys/class/drm/renderD130/device/class", "0x120000\n")
    probe = XpuPlatform.probe_root(tmp_path)
    assert probe.device_count == 1 and probe.details["devices"] == "0x0bd5"
    assert (
        probe.available
        if torch_has_library("libtorch_xpu.so")
        else "no XPU support; install a XPU build" in probe.reason
    )
    monkeypatch.setenv("ZE_AFFINITY_MASK", "")
    assert "1 hidden by ZE_AFFINITY_MASK" in XpuPlatform.probe_root(tmp_path).reason


def test_gpu_platforms_share_one_base_and_differ_only_in_what_differs():
    from weft.contracts.gpu_platform import GpuPlatform, triton_backend_installed
    from weft_cuda.platform import CudaPlatform
    from weft_rocm.platform import RocmPlatform
    from weft_xpu.platform import XpuPlatform

    assert all(issubclass(platform, GpuPlatform) for platform in (CudaPlatform, RocmPlatform, XpuPlatform))
    facts = {
        platform.name: (
            platform.device_type,
            platform.distributed_backend,
            platform.supports_graph_capture,
            platform.triton_backend,
        )
        for platform in (CudaPlatform, RocmPlatform, XpuPlatform)
    }
    assert facts == {
        "cuda": ("cuda", "nccl", True, "nvidia"),
        "rocm": ("cuda", "nccl", True, "amd"),  # HIP through torch.cuda; RCCL behind the nccl backend; HIP graphs
        "xpu": ("xpu", "xccl", False, "intel"),
    }
    for platform in (CudaPlatform, RocmPlatform, XpuPlatform):
        own = set(vars(platform)) - {
            "__module__",
            "__doc__",
            "__qualname__",
            "__firstlineno__",
            "__static_attributes__",
        }
        assert own <= {
            "name",
            "device_type",
            "distributed_backend",
            "supports_graph_capture",
            "vendor",
            "runtime",
            "torch_library",
            "visibility_variables",
            "triton_backend",
            "scan",
            "device_arch",
            "__abstractmethods__",
            "_abc_impl",
            "__annotations__",
            "communicator",
            "float8_unsupported",
        }, own  # CUDA's peer-memory all-reduce (weft_cuda.communicator); where fp8 runs (compute capability 8.9+)
        assert platform.default_attention == (
            "triton" if triton_backend_installed(platform.triton_backend) else "torch"
        )
    with pytest.raises(NotImplementedError, match="does not capture graphs"):
        XpuPlatform().capture_graph(lambda: None)


def test_gpu_base_takes_memory_dtype_device_and_arch_from_the_device_module(monkeypatch):
    """The base's device-facing half on a stand-in for ``torch.xpu`` (no Intel GPU here)."""
    from types import SimpleNamespace

    import torch

    from weft_xpu.platform import XpuPlatform

    selected, total, bf16 = [], [141 << 30], [True]
    module = SimpleNamespace(
        mem_get_info=lambda index: (total[0] // 2, total[0]),
        set_device=selected.append,
        is_bf16_supported=lambda: bf16[0],
        current_device=lambda: 1,
    )
    monkeypatch.setattr(XpuPlatform, "device_module", property(lambda self: module))
    monkeypatch.setattr(XpuPlatform, "device_arch", lambda self, index: f"pvc-{index}")
    platform = XpuPlatform()
    assert platform.memory_info(0).total == 141 << 30 and platform.memory_info(0).free == 141 << 29
    sizes = []
    for gib in (141, 48, 16):
        total[0] = gib << 30
        defaults = platform.engine_defaults()
        sizes.append((defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.async_scheduling))
    assert sizes == [(512, 16384, True), (256, 4096, True), (128, 2048, True)]
    assert platform.default_dtype() == "bfloat16"
    bf16[0] = False
    assert platform.default_dtype() == "float16"  # a device without bf16 arithmetic
    assert platform.select_device(2) == torch.device("xpu", 2) and selected == [2]
    assert (
        platform.launch_arch(torch.device("xpu")) == "pvc-1" and platform.launch_arch(torch.device("xpu", 3)) == "pvc-3"
    )


def test_the_arch_option_forces_the_launch_arch_without_a_device():
    import msgspec
    import torch

    from weft_rocm.platform import RocmPlatform

    forced = RocmPlatform(RocmPlatform.Options(arch="gfx950"))
    assert (
        forced.launch_arch(torch.device("cuda", 3)) == "gfx950" and forced.launch_arch(torch.device("cpu")) == "gfx950"
    )
    assert RocmPlatform().launch_arch(torch.device("cpu")) == ""  # another device type: no architecture to tune for
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"arch": 950}, RocmPlatform.Options)


@pytest.mark.parametrize(("value", "expected"), [(None, 4), ("", 0), ("-1", 0), ("0,2", 2), ("0,1,2,3,4,5", 4)])
def test_visible_device_count(monkeypatch, value, expected):
    from weft.contracts.platform import visible_device_count

    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_device_count(4, "CUDA_VISIBLE_DEVICES") == expected


def test_without_triton_the_kernels_step_aside_for_the_torch_references():
    """On a machine without Triton (hidden here), weft-triton's entry points still import, a GPU platform's
    default attention and every op fall back to core's torch implementations, and naming the Triton
    backend fails with the fix."""
    import json
    import subprocess
    import sys

    code = """
import json, sys
sys.modules["triton"] = None
from weft.plugins import PluginRegistry
from weft.plugins.selection import choose_op
from weft_rocm.platform import RocmPlatform
from weft_triton.attention import TritonAttention
registry = PluginRegistry()
platform = RocmPlatform()
ops = {op: type(choose_op(registry, op, platform)).__name__ for op in ("decode_topk", "linear", "rms_norm")}
try:
    TritonAttention(None, platform)
    error = ""
except RuntimeError as caught:
    error = str(caught)
print(json.dumps({"attention": RocmPlatform.default_attention, "ops": ops, "error": error}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["attention"] == "torch"
    assert report["ops"] == {"decode_topk": "DecodeTopKTorch", "linear": "LinearTorch", "rms_norm": "RmsNormTorch"}
    assert "needs the triton package" in report["error"] and "use.attention = 'torch'" in report["error"]


def test_triton_attention_refuses_a_platform_without_a_triton_backend(monkeypatch):
    from weft.builtins.cpu import CpuPlatform
    from weft_triton.attention import TritonAttention

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="cannot run on platform 'cpu'.*use.attention = 'torch'"):
        TritonAttention(None, CpuPlatform())
