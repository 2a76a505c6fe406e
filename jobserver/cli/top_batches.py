"""`jobserver top --batch ID`: how far batches have come (create --then,
the client's create_batch), each read from its completion job's QueryJob:
`dependencyCounts` counts the batch's jobs by how they ended (protocol.md
14.25). A completion job that is gone (it ran, finished and was deleted)
is shown so; a job that depends on nothing has no counts to show."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobserver.client import Client, JobNotFound

# The columns after the batch's completion job and its state, by the
# names of dependencyCounts; ENDED is total less pending.
COUNTED = ("finished", "failed", "cancelled", "deleted")


@dataclass(frozen=True)
class Watched:
    """A batch watched: its completion job's ID and QueryJob, None once
    the job is gone."""

    job_id: int
    job: dict[str, Any] | None


def read(client: Client, ids: list[int]) -> list[Watched]:
    """Each completion job of `ids`, as the server has it now."""
    watched = []
    for job_id in ids:
        try:
            job: dict[str, Any] | None = client.query_job(job_id)
        except JobNotFound:
            job = None
        watched.append(Watched(job_id, job))
    return watched


def table(
    watched: list[Watched], clean: Callable[[str], str], cut: Callable[[str], str]
) -> list[str]:
    """The batches' lines: a row each, numbers right-aligned. `clean` and
    `cut` are top's, for what the server says."""
    header = ["BATCH", "THEN", "STATE", "ENDED", *(name.upper() for name in COUNTED)]
    rows = [_row(batch, clean, cut) for batch in watched]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [f"batches: {len(watched)} watched", *(_line(row, widths) for row in [header, *rows])]


def _row(batch: Watched, clean: Callable[[str], str], cut: Callable[[str], str]) -> list[str]:
    if batch.job is None:
        return [str(batch.job_id), "-", "gone", *["-"] * (1 + len(COUNTED))]
    name = cut(clean(str(batch.job.get("name", ""))))
    state = clean(str(batch.job.get("state", "?")))
    counts = batch.job.get("dependencyCounts")
    if not isinstance(counts, dict):
        return [str(batch.job_id), name, state, *["-"] * (1 + len(COUNTED))]
    total, pending = _number(counts.get("total")), _number(counts.get("pending"))
    ended = f"{total - pending}/{total}" if total is not None and pending is not None else "?"
    return [
        str(batch.job_id), name, state, ended,
        *(_shown(_number(counts.get(name))) for name in COUNTED),
    ]


def _number(value: object) -> int | None:
    return value if type(value) is int else None


def _shown(value: int | None) -> str:
    return "?" if value is None else str(value)


def _line(cells: list[str], widths: list[int]) -> str:
    """The jobID, name and state left-aligned, the counts right-aligned."""
    left = [cell.ljust(width) for cell, width in zip(cells[:3], widths[:3], strict=True)]
    right = [cell.rjust(width) for cell, width in zip(cells[3:], widths[3:], strict=True)]
    return "  ".join(left + right).rstrip()
