"""weft-triton: Weft's Triton kernels, for every platform whose Triton backend is installed.

The kernels are written once against Triton and run on NVIDIA (CUDA), AMD (ROCm) and Intel
(XPU) GPUs, and on the CPU under ``TRITON_INTERPRET=1`` for tests. A platform names its Triton
backend (:attr:`weft.contracts.gpu_platform.GpuPlatform.triton_backend`); an implementation here
is available where that backend is installed (:func:`weft_triton.runtime.runs_on`). Modules
named as entry points (``attention``, ``ops``) import Triton only when an implementation is
built, so listing or selecting plugins on a machine without Triton loads them fine.
"""
