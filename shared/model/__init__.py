"""A model plugin's Keras model as downpour handles it: built and checked, fingerprinted,
its tables found, initial values per row and per id, ids hashed to shards, variables
partitioned over shards, and the TF1 graph form.
"""
