"""Many jobs in a state, made fast for the tests of bulk actions: created
with CreateJobs (pipelined, a thousand each, for a hundred thousand),
taken with GetJobs and failed with pipelined FailJobs."""

from __future__ import annotations

from helpers import ok
from jobserver.model.globmatch import MAX_SET_CHARACTERS
from jobserver.wire.limits import BULK_PATTERN_BUDGET, MAX_RESULTS, SET_CHARACTER_WEIGHT
from wire import Client, encode

# A costly pattern, of a set as large as sets may be, that matches the
# names `n/...x`, and how many jobs a search for it examines: the budget
# over its bytes from the star and the weight of its set's characters.
COSTLY = (
    "n/*[" + "x" * (MAX_SET_CHARACTERS - 1) + "y]",
    BULK_PATTERN_BUDGET // (MAX_SET_CHARACTERS + 3 + SET_CHARACTER_WEIGHT * MAX_SET_CHARACTERS),
)

# Jobs a CreateJobs of queue_many creates, and CreateJobs sent at once.
BATCH = 1000
PIPELINED = 10


def create_many(
    client: Client, names: list[str], headers: dict[str, str] | None = None
) -> list[int]:
    """CreateJobs of one job per name; their jobIDs, in order."""
    jobs = [{"name": name} for name in names]
    ids: list[int] = ok(client.request("CreateJobs", headers, jobs=jobs)).json["jobIDs"]
    assert len(ids) == len(names)
    return ids


def queue_many(client: Client, names: list[str]) -> None:
    """QUEUED jobs of these names: CreateJobs of a thousand, sent ten at a
    time before their replies are read (all at once, the replies unread
    could fill the socket's buffers and stop both ends)."""
    requests = [
        encode("CreateJobs", {"jobs": [{"name": name} for name in names[at : at + BATCH]]})
        for at in range(0, len(names), BATCH)
    ]
    for at in range(0, len(requests), PIPELINED):
        sent = requests[at : at + PIPELINED]
        client.send(b"".join(sent))
        for _ in sent:
            ok(client.read_reply())


def failed_jobs(
    client: Client, names: list[str], headers: dict[str, str] | None = None
) -> list[int]:
    """One FAILED job per name (no other job may be due meanwhile); their jobIDs."""
    extra = headers or {}
    ids = sorted(create_many(client, names, extra))
    taken: list[int] = []
    while len(taken) < len(ids):  # GetJobs hands out at most MAX_RESULTS at once
        reply = ok(client.request("GetJobs", extra, name="*", numResults=MAX_RESULTS))
        taken += [job["jobID"] for job in reply.json["jobs"]]
    assert sorted(taken) == ids
    client.send(b"".join(encode("FailJob", {**extra, "jobID": i, "error": "boom"}) for i in ids))
    for _ in ids:
        ok(client.read_reply())
    return ids


def states(client: Client, ids: list[int], headers: dict[str, str] | None = None) -> dict[int, str]:
    """Each job's state, or "gone"."""
    found = {}
    for job_id in ids:
        reply = client.request("QueryJob", headers or {}, jobID=job_id)
        found[job_id] = reply.json["state"] if reply.code == 200 else "gone"
    return found
