"""How every process speaks to a server: ZeroMQ sockets, the shard client, the shard set,
CURVE security.

Layered as in ps-lite: ``transport`` (sockets, deadlines, Lazy Pirate, retries) under
``client`` (one server: hello, pull, heartbeat, status, splits) under ``cluster`` (every
shard at once). ``receive`` takes a whole message within bounds; ``security`` sets CURVE and
the ZAP allow-lists on every socket. The worker, ``downpour status``, the chief and the tests
all speak through ``client`` and ``cluster``; retries live there, not in their callers.
"""
