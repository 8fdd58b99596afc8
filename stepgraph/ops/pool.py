"""(family pool: filled in below)"""
