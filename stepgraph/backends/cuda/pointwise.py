"""(cuda family pointwise: filled in below)"""
IMPLS: dict = {}
