"""Many jobs in a state, made fast for the tests of bulk actions: created
with CreateJobs (pipelined, a thousand each, for a hundred thousand),
taken with GetJobs and failed with pipelined FailJobs."""

from __future__ import annotations

from helpers import ok
from jobserver.wire.limits import BULK_TEST_BUDGET, MAX_RESULTS
from wire import Client, encode

# A costly pattern, a star then a long literal, matching the names
# costly_name(i), and how many jobs a search for it examines: the budget
# over what it may cost to test a name, 1 unit and 5 for each of the 241
# bytes from its star (globmatch.match_cost).
COSTLY = ("n/*" + "x" * 240, BULK_TEST_BUDGET // (1 + 5 * 241))


def costly_name(i: int) -> str:
    return f"n/{i}" + "x" * 240

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
