"""Embedding tables on the server: the dynamic table (ids of any value, rows created on first
touch, admission and eviction) with its index, sketch, storage and checkpoint part, and the
row-wise optimizer updates of every table.
"""
