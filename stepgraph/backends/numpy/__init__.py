from .backend import NumpyBackend

__all__ = ["NumpyBackend"]
