"""Keras layers for tables of ids of any value: what a model plugin builds its tables with.

``DynamicEmbedding`` (``dynamic``): a table for ids of any value (int64 hashes, strings) in a
row budget, one semantics in one process and on downpour's servers; ``bags``: multi-valued
features (ragged, sparse, padded) pooled by a combiner, and ``string_ids``;
``DistributedEmbedding`` (``distributed``): tables and features declared as keras-rs declares
them, several features to a table.
"""

from downpour.layers.bags import COMBINERS, embed, string_ids
from downpour.layers.distributed import DistributedEmbedding, FeatureConfig, TableConfig
from downpour.layers.dynamic import DynamicEmbedding, served

__all__ = [
    "COMBINERS",
    "DistributedEmbedding",
    "DynamicEmbedding",
    "FeatureConfig",
    "TableConfig",
    "embed",
    "served",
    "string_ids",
]
