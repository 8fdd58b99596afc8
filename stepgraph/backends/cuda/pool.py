"""(cuda family pool: filled in below)"""
IMPLS: dict = {}
