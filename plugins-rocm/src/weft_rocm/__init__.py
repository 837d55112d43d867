"""weft-rocm: the ROCm platform for Weft. Importing this package imports neither torch nor HIP."""
