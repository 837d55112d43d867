"""weft-xpu: the Intel XPU platform for Weft. Importing this package imports neither torch nor Level Zero."""
