"""weft-gguf: load GGUF checkpoints (dequantized to the runtime dtype) and their tokenizers."""
