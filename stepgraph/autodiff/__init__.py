from .vjp import append_backward

__all__ = ["append_backward"]
