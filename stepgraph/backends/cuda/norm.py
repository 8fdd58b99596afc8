"""(cuda family norm: filled in below)"""
IMPLS: dict = {}
