"""An example out-of-tree Weft KV connector (see docs/plugin-authors.md)."""
