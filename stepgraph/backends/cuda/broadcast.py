"""(cuda family broadcast: filled in below)"""
IMPLS: dict = {}
