"""Where jobs are kept: the interface the core needs, and SQLite behind it."""
