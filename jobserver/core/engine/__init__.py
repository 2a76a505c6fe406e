"""The engine: the writer and its group commit, durability, the wait queue,
the clock and what it drives (deadlines, stale jobs, retention)."""
