"""Weights before each step: the puller, a fetcher thread per shard, and when a prefetched
pull is requested.
"""
