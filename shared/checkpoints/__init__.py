"""The checkpoint format, in one place for every reader and writer.

``store`` reads and writes the ``ckpt-*.npz`` files of one state directory; ``layout`` says
what each array of a checkpoint is and which old rows make up a new part; ``npz`` maps an
archive's arrays into memory. The server writes checkpoints and restores from them; export,
serving, the chief and ``run-local`` read them through this package.
"""
