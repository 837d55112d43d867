"""Kernels: the warm-up contract that keeps JIT compilation out of serving."""
