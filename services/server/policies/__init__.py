"""Staleness policies: how the server treats a gradient by how old it is (counts, compensation
by how the weights moved, hybrid dense/rows), each built from its ``--policy`` form
(``downpour.config.policy`` holds the grammar and the capabilities), and the weights'
movement that bounded pulls read.
"""
