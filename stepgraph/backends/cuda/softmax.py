"""(cuda family softmax: filled in below)"""
IMPLS: dict = {}
