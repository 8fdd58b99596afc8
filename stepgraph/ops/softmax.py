"""(family softmax: filled in below)"""
