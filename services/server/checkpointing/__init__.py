"""The server's side of checkpoints: which checkpoints a shard restores from, and restoring
them onto any number of shards (the format itself is ``downpour.checkpoints``).
"""
