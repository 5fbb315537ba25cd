"""Bytes in memory: aligned and private buffers, TensorFlow tensors to NumPy and back without
a copy, and the C allocator's arenas.
"""
