"""Core ops: the torch reference of each named kernel (platform plugins add faster implementations)."""
