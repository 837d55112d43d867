"""Shared torch layers: norms, rotary embeddings, the attention layer."""
