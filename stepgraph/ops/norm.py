"""(family norm: filled in below)"""
