"""weft-weight-cache: weights kept resident by a per-device daemon (``weft weights serve``) and mapped by
engines over IPC (``use.loader = "weight-cache"``) instead of read from disk."""
