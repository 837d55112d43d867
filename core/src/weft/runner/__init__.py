"""The model runner: flat batches in, sampled tokens out."""
