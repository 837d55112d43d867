"""weft-fastsafetensors: the ``fastsafetensors`` weight loader (``use.loader = "fastsafetensors"``)."""
