"""The model runner: flat batches in, sampled tokens out; the worker that owns it, and a worker
process's main function."""
