"""What the searches of storage take and give, as values: a bulk action's
names (NameMatch) and what it found (Found), and what a hand-out search
has passed over (PassedOver), which the next page leaves out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NameMatch:
    """Which names a bulk action's search takes (protocol.md 14.19): those
    a GLOB `pattern` matches, or one of `names`, or a `queue`'s (the name
    itself, or one that starts with it and a `/`)."""

    pattern: str | None = None
    names: tuple[str, ...] = ()
    queue: str | None = None


@dataclass(frozen=True)
class PassedOver:
    """What a hand-out search has passed over, so that its next page of
    candidates leaves it out in the query itself: every job up to `after`
    in hand-out order (priority in the search's order, then nextRun, name
    and jobID: the last job it read), and every job of the `names`, or of
    a name one of the GLOB `patterns` matches, that limits or pauses hold
    whatever their cost; and the same of one key alone (a per-key or fair
    limit holds one key's jobs): `pairs` of a name and a key, and
    `keyed` (pattern, key). The held names and patterns bound the work,
    not the held jobs."""

    after: tuple[int, str, str, int] | None = None
    names: frozenset[str] = frozenset()
    patterns: tuple[str, ...] = ()
    pairs: frozenset[tuple[str, str]] = frozenset()
    keyed: tuple[tuple[str, str], ...] = ()


def pair_text(name: str, key: str) -> str:
    """A held name of one key as the searches compare it: neither holds a
    line break (protocol.md 5.1, 14.23)."""
    return f"{name}\n{key}"


NOTHING_PASSED = PassedOver()


@dataclass(frozen=True)
class Found:
    """What a bulk action's search found: the jobIDs of the oldest jobs
    that match, oldest first; how many match among the jobs examined; how
    many were examined, and whether those were all that could match (if
    not, more may match beyond them)."""

    job_ids: list[int]
    matched: int
    examined: int
    complete: bool
