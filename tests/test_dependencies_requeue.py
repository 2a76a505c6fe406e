"""A dependency requeued after it ended (protocol.md 14.25): RequeueJobs
makes it live again, so a job that depends on it waits for its next end
and hears of it. Real servers on SQLite and PostgreSQL.

Found by an attacker's review: the first end's outcome stayed kept, so a
dependent created after the requeue counted the requeued job as FAILED
while it was QUEUED, and its next end, kept already, was told to no one:
the dependent stayed BLOCKED for good (and after a restart failed for a
dependency that had FINISHED)."""

from __future__ import annotations

import pytest
from test_dependencies import query, state, take

from helpers import create, ok

pytestmark = pytest.mark.backends


def test_a_dependent_of_a_requeued_job_waits_for_its_next_end(server, client):
    first = create(client, "x")
    earlier = create(client, "earlier", dependsOn=f"[{first}]", onDependencyFailure="run")
    assert take(client, "x") is not None
    ok(client.request("FailJob", jobID=first, error="no"))
    assert state(client, earlier) == "QUEUED"
    ok(client.request("RequeueJobs", jobIDs=str(first)))
    later = create(client, "later", dependsOn=f"[{first}]")
    shown = query(client, later)
    assert shown["state"] == "BLOCKED"
    assert (shown["dependencyCounts"]["pending"], shown["dependencyCounts"]["failed"]) == (1, 0)
    assert take(client, "x") is not None
    ok(client.request("FinishJob", jobID=first, data='{"ok": 1}'))
    handed = take(client, "later")
    assert handed is not None and handed["jobID"] == later
    assert [(d["jobID"], d["state"], d["data"]) for d in handed["dependencies"]] == [
        (first, "FINISHED", {"ok": 1})
    ]
    # The dependent of the first end kept what it was told then.
    assert state(client, earlier) == "QUEUED"


def test_a_blocked_dependent_counts_a_requeued_dependency_as_pending_again(server, client):
    first, second = create(client, "x"), create(client, "y")
    waiting = create(client, "both", dependsOn=f"[{first}, {second}]", onDependencyFailure="run")
    assert take(client, "x") is not None
    ok(client.request("FailJob", jobID=first, error="no"))
    ok(client.request("RequeueJobs", jobIDs=str(first)))
    assert take(client, "y") is not None
    ok(client.request("FinishJob", jobID=second))
    # Its first dependency lives again: not all have ended.
    assert state(client, waiting) == "BLOCKED"
    assert take(client, "x") is not None
    ok(client.request("FinishJob", jobID=first))
    assert state(client, waiting) == "QUEUED"
