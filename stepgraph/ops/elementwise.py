"""(family elementwise: filled in below)"""
