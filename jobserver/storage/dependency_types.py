"""What the core asks of a store about dependencies (protocol.md 14.25):
the graph's edges, the outcomes of the jobs depended on, and the count of
what each dependent still waits for. storage/interface.py's Storage has
them; sql_dependencies.py writes them in SQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from jobserver.model.jobs import Job


@dataclass(frozen=True)
class Outcome:
    """How a job depended on ended, as its dependents see it: its final
    state (FINISHED, FAILED, CANCELLED or DELETED; "" while it has not
    ended), and its data ("" when left out for the hand-out's budget)."""

    job_id: int
    state: str
    data: str
    omitted: bool = False


class Dependencies(Protocol):
    """In the writer's transaction, like interface.Jobs."""

    def depended_on(self, ids: Sequence[int]) -> dict[int, Job]:
        """The jobs of `ids` that exist, locked where other nodes write (in
        jobID order), so that none ends unseen while edges to it are added."""

    def outcomes_of(self, ids: Sequence[int]) -> dict[int, Outcome]:
        """The kept outcomes of the jobs of `ids` that have one."""

    def add_dependencies(self, edges: Sequence[tuple[int, int]]) -> None:
        """Store the edges (dependent, dependency), and count each
        dependency's new dependents."""

    def keep_outcomes(self, outcomes: Sequence[Outcome], only_if_depended_on: bool) -> list[int]:
        """Keep jobs' outcomes for their dependents (only those some edge
        names, if `only_if_depended_on`); the jobIDs whose outcome is new
        (not those kept already: the job had ended before, and its
        dependents were told then)."""

    def forget_outcomes(self, ids: Sequence[int]) -> None:
        """The jobs of `ids` live again (RequeueJobs of a job that had
        ended): their kept outcomes go, so that their dependents wait for
        their next end, and hear of it."""

    def edges_from(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """The edges (dependent, dependency) from the jobs of `ids`."""

    def blocked_dependents(self, ended: Sequence[int], limit: int) -> list[int]:
        """The BLOCKED jobs that depend on jobs of `ended`, at most `limit`
        of them, the lowest jobIDs first; locked where other nodes write."""

    def behind(self, after: int, examine: int) -> list[tuple[int, bool]]:
        """The next `examine` BLOCKED jobs after jobID `after`, in jobID
        order, each with whether it is behind its dependencies' outcomes
        (some ended that it has not counted: a cascade left for later)."""

    def settle(self, ids: Sequence[int]) -> list[tuple[Job, int, Outcome | None]]:
        """Count again what each still BLOCKED job of `ids` waits for, from
        the stored outcomes (the same answer however often it is asked):
        each job, locked where other nodes write, with its blockers left and
        the outcome of its lowest dependency that ended other than
        FINISHED (None if none did), by jobID."""

    def dependency_outcomes(self, job_id: int, budget: int) -> list[Outcome]:
        """Each dependency of `job_id` with its outcome, by jobID; the data
        of those past `budget` bytes in all left out (`omitted`)."""

    def dependency_counts(self, job_id: int) -> dict[str, int]:
        """How many dependencies of `job_id` have each outcome state ("" for
        those that have not ended)."""

    def forget_dependencies(self, ids: Sequence[int]) -> None:
        """The jobs of `ids` are gone: their edges, and the outcomes no
        edge names any more, go too."""
