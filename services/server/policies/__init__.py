"""Staleness policies: how the server treats a gradient by how old it is (counts, compensation
by how the weights moved, hybrid dense/rows), the ``--policy`` forms, and the weights'
movement that bounded pulls read.
"""
