"""A count and its noun as people read them: `1 job`, `2 jobs`, `0 jobs`.
Shared by the command line, the workers' logs and the dashboard."""

from __future__ import annotations


def noun_for(count: int, noun: str, nouns: str | None = None) -> str:
    """`noun` for one, else `nouns` (by default `noun` and an s)."""
    return noun if count == 1 else nouns or f"{noun}s"


def counted(count: int, noun: str, nouns: str | None = None) -> str:
    """`1 handler`, `3 handlers`: the count before its noun."""
    return f"{count} {noun_for(count, noun, nouns)}"
