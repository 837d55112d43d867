"""weft-cuda: the CUDA platform for Weft. Importing this package imports neither torch nor CUDA."""
