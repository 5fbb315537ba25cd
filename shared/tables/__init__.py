"""What a dynamic table is, in any process: its declared budget and policies (``policy``),
which ids hold rows of their own and which fallback row the others read (``rowmap``), its id
index (``index``) and admission sketch (``sketch``).

A server shard's ``downpour.server.tables.table.DynamicTable`` and the one-process
``downpour.layers.DynamicEmbedding`` both place ids through ``rowmap.RowMap``, so a table
decides alike in ``model.fit`` and on the servers. NumPy only: no TensorFlow.
"""
