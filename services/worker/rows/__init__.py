"""Row pulls: which tables go by row (the plan), the bounded row cache that holds them, and the
puller that installs row replies and tops up stale rows.
"""
