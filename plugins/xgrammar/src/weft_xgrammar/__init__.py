"""weft-xgrammar: Weft's structured-output backend on xgrammar (importing this package imports nothing else)."""
