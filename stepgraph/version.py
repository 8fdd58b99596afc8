"""stepgraph's version: a leaf module (it imports nothing), so that any module may read it
without importing the package's __init__ (the CUDA backend keys cached kernel choices on it)."""
__version__ = "0.1.0"
