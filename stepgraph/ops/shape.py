"""(family shape: filled in below)"""
