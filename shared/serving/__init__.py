"""Serving follows training: SavedModel exports with each dynamic table a hash-table lookup,
row deltas between exports, numbered versions as TF Serving watches them, and scoring the
servers' model from a copy outside training.
"""
