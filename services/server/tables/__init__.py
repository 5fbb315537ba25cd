"""Embedding tables on the server: the dynamic table (ids of any value, rows created on first
touch, admission and eviction) with its index, sketch, storage and checkpoint part, a shard's
tables together (``shard``), and the row-wise optimizers of every table: one update rule per
kind (``optim``), run on NumPy rows by the dynamic table and on a fixed table's Keras
variables by ``rows``.
"""
