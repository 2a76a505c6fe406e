"""The engine: group commit, durability, the wait queue and the clock that
drive the writer's transactions, and what the clock and the pruner do
(deadlines, stale jobs, retention)."""
