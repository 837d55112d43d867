"""An example out-of-tree Weft plugin (see docs/plugin-authors.md)."""
