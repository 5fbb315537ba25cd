"""64-bit mixing for ids: the one function that spreads ids over shards and keys their values.

``mix64`` is SplitMix64's finaliser; ``id_shard`` routes an id of a dynamic table to the
shard that owns it; ``as_ids`` checks an array of ids. NumPy only, so anything may import it.
"""

from __future__ import annotations

import numpy as np

MIX64_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # SplitMix64's finaliser
_M1, _M2 = (np.uint64(m) for m in MIX64_MULTIPLIERS)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 ``x`` (elementwise): a bijection of 64-bit words
    whose every output bit depends on every input bit. Arithmetic wraps modulo 2**64."""
    with np.errstate(over="ignore"):
        z = (x ^ (x >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def id_shard(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (int64, in ``[0, num_shards)``) owning each int64 id of a dynamic table:
    ``mix64(id) % num_shards``, so consecutive or patterned ids spread evenly and every
    process routes an id alike."""
    ids = np.asarray(ids, np.int64)
    if num_shards == 1:
        return np.zeros(ids.shape, np.int64)
    return (mix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)


def as_ids(ids: object) -> np.ndarray:
    """``ids`` as a 1-D int64 array; ValueError for anything else (another rank, a
    non-integer dtype, unsigned values past 2**63 - 1)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError("ids must fit int64")
    return arr.astype(np.int64, copy=False)
