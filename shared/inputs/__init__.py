"""A model's input: what ``input_fn`` is told (``context``), in-memory data sets (``data``) and
the tf.data pipeline built from a spec's input functions (``pipeline``).
"""
