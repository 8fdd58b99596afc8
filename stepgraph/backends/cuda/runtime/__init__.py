"""Shared machinery of the CUDA backend: compilation, launch helpers, capture, streams."""
