"""`jobserver create --from FILE|-`: many jobs from JSON lines, one job
object per line with the fields CreateJobs takes, sent in CreateJobs
batches.

Every line is read and checked before anything is sent, so a file with a
bad line creates nothing and the message names the line. The server
creates each batch all or none; a batch it refuses ends the run, and the
jobs of the batches before it stay created, their jobIDs printed. Each
batch goes under an idempotency key of its own, the run's key and its
number, so the same command run again with the same key creates only the
batches that were not created.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from jobserver.cli.client_command import PartlyRefused, UsageError
from jobserver.client import (
    Client,
    ConnectionFailed,
    JobServerError,
    OutcomeUnknown,
    ServerError,
)
from jobserver.client.batches import MAX_BATCH, completion_job
from jobserver.wire import jsonbody
from jobserver.wire.client_framing import encode_value
from jobserver.wire.limits import MAX_IDEMPOTENCY_KEY, MAX_LINE

# Jobs per CreateJobs: one transaction and one reply of ordinary size. The
# server bounds a batch only by the length of its `jobs` line.
BATCH_JOBS = 1000
# The bytes a batch's jobs may take on its `jobs` line: the line's limit
# less its name, brackets and line end.
BATCH_BYTES = MAX_LINE - len("jobs: []\r\n")
# The longest --idempotency-key with --from: room left for "/N", N up to
# seven digits (a file of four gigabytes holds fewer batches).
MAX_BATCH_KEY = MAX_IDEMPOTENCY_KEY - 8


@dataclass(frozen=True)
class Line:
    """One job of the input: its line number, its object, and the bytes it
    takes on the wire (escaped JSON)."""

    number: int
    job: dict[str, object]
    size: int


def create_from(client: Client, stream: BinaryIO, key: str) -> dict[str, list[int]]:
    """Create the jobs of every line of `stream`; {"jobIDs": [...]} in line
    order. Batch N goes under idempotency key `key`/N, so a run again with
    the same key and lines creates only what was not created. UsageError
    for a line that is not a job, before anything is sent; PartlyRefused,
    with the jobIDs created, when a batch fails."""
    created: list[int] = []
    for number, batch in enumerate(batches(read_jobs(stream))):
        try:
            created += client.create_jobs([line.job for line in batch], f"{key}/{number}")
        except (JobServerError, ConnectionFailed) as error:
            complaint = _batch_failed(batch, error, key)
            raise PartlyRefused({"jobIDs": created}, [complaint], error) from None
    return {"jobIDs": created}


def create_batch_from(
    client: Client, stream: BinaryIO, then: dict[str, Any], key: str
) -> dict[str, Any]:
    """The jobs of every line of `stream` as one batch (`create --then`):
    one CreateJobs, all or none, under idempotency key `key`, whose last
    job, `then`, depends on all of them and runs once each has ended.
    {"jobIDs": [...], "thenJobID": N}. UsageError, before anything is
    sent, for a line that is not a job, no lines, more than a batch holds
    or more than one request line carries."""
    lines = read_jobs(stream)
    if not 1 <= len(lines) <= MAX_BATCH:
        raise UsageError(
            f"--then makes one batch of 1 to {MAX_BATCH} jobs (its completion job depends on "
            f"each), and --from has {len(lines)}: split the file, a --then for each part"
        )
    # Each line fits (read_jobs); the batch must fit one line, its
    # completion job and the commas between them included.
    completion = completion_job(then, len(lines))
    size = sum(line.size + 1 for line in lines) + len(encode_value(completion).encode("utf-8"))
    if size > BATCH_BYTES:
        raise UsageError(
            f"--then sends the batch in one request, and its jobs take {size} bytes on the "
            f"wire, more than a CreateJobs line holds ({BATCH_BYTES}): split the file"
        )
    batch = client.create_batch([line.job for line in lines], then, key)
    return {"jobIDs": batch.job_ids, "thenJobID": batch.then_id}


def run_again(key: str) -> str:
    """How to try again without creating anything twice."""
    return f"run the command again with --idempotency-key {key} to create nothing twice"


def read_jobs(stream: BinaryIO) -> list[Line]:
    """Every job of `stream`, one JSON object a line; blank lines are
    skipped. UsageError naming the first line that is not a job."""
    jobs = []
    number = 0
    # A line is read up to its bound, so a file without line breaks cannot
    # fill memory before it is refused.
    while raw := stream.readline(MAX_LINE + 1):
        number += 1
        if len(raw) > MAX_LINE:
            raise UsageError(f"--from line {number}: longer than {MAX_LINE} bytes")
        try:
            line = _job(number, raw)
        except ValueError as error:
            raise UsageError(f"--from line {number}: {error}") from None
        if line is not None:
            jobs.append(line)
    return jobs


def _job(number: int, raw: bytes) -> Line | None:
    """The job of one line, None for a blank one; ValueError saying what is
    wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    if not text.strip():
        return None
    try:
        job = jsonbody.parse(text.strip())
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg} at column {error.colno})") from None
    except ValueError as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(job, dict):
        raise ValueError(f"not a JSON object: {text.strip()[:40]!r}")
    # CreateJobs reads its fields' names in any case (protocol.md 5.2).
    name = {key.lower(): value for key, value in job.items()}.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('no "name": each line is a job object such as {"name": "email/send"}')
    try:
        size = len(encode_value(job).encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("holds a lone surrogate (\\ud800 to \\udfff): not UTF-8") from None
    if size > BATCH_BYTES:
        raise ValueError(
            f"the job takes {size} bytes on the wire, more than a CreateJobs line holds "
            f"({BATCH_BYTES})"
        )
    return Line(number, job, size)


def batches(lines: list[Line]) -> Iterator[list[Line]]:
    """The lines in order, cut into CreateJobs batches of at most
    BATCH_JOBS jobs and BATCH_BYTES bytes (a comma between two jobs)."""
    batch: list[Line] = []
    size = 0
    for line in lines:
        if batch and (len(batch) == BATCH_JOBS or size + 1 + line.size > BATCH_BYTES):
            yield batch
            batch, size = [], 0
        size += line.size + (1 if batch else 0)
        batch.append(line)
    if batch:
        yield batch


def _batch_failed(batch: list[Line], error: JobServerError | ConnectionFailed, key: str) -> str:
    lines = f"lines {batch[0].number} to {batch[-1].number}"
    if isinstance(error, OutcomeUnknown) or (isinstance(error, ConnectionFailed) and error.sent):
        return (
            f"{lines}: {error}; their jobs may or may not have been created, "
            f"later lines were not sent: {run_again(key)}"
        )
    if isinstance(error, ServerError | ConnectionFailed):
        return (
            f"{lines}: {error}; none of their jobs was created, nor of later lines: "
            f"{run_again(key)}"
        )
    return f"{lines}: {error}; none of their jobs was created, nor of later lines"
