"""A model of the job queue, checked against a real server step by step.

Hypothesis drives CreateJob, GetJob, GetJobs, FinishJob, FinishJobs,
RetryJob, FailJob, DeleteJob and QueryJob from three connections against one server per test
case, and keeps a Python model of every job's state. Each answer (status
line, which jobs are handed out and in what order) must be the model's, and
after every step the whole jobs table must match the model.

Every job is created due at once. A retried job (delay 3600) and a finished
repeating job (`FINISHED, +1 HOUR`) are due only an hour later, so within a
test case nothing becomes due by itself and the model needs no clock.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from contextlib import closing
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatchcase
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from harness import ThreadServer
from wire import Reply

NAMES = ["a", "b", "c/x", "c/y"]
PATTERNS = ["a", "b", "c/x", "*", "c/*", "[ab]", "?", "a, c/y", "b,c/x,nothing"]
PRIORITIES = [None, 0, 500, 1000]
REPEAT = "FINISHED, +1 HOUR"
CLIENTS = 3
MISSING = 10**9  # a jobID no test case reaches

NO_JOB = "404 No job with this jobID"
NOT_RUNNING = "405 Can only retry/finish RUNNING and RUNQUEUED jobs"
CANNOT_FAIL = "405 Can only fail RUNNING or RUNQUEUED jobs"
CANNOT_DELETE = "405 Can't delete a RUNNING job"


@dataclass
class Job:
    job_id: int
    name: str
    priority: int
    repeat: str
    state: str  # QUEUED, RUNNING or FAILED
    due: bool
    next_run: str  # as the server stored it at creation: the hand-out order
    handed_out: bool = False


def matches(pattern: str, name: str) -> bool:
    """protocol.md 5.3: a comma list of exact names, else a GLOB."""
    pieces = [piece.lstrip(" ") for piece in pattern.split(",") if piece.lstrip(" ")]
    if len(pieces) > 1:
        return name in pieces
    return fnmatchcase(name, pattern)


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")


class JobQueueModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="jobserver-model-"))
        self.server = ThreadServer(self.dir / "jobs.db")
        self.clients = [self.server.client() for _ in range(CLIENTS)]
        self.jobs: dict[int, Job] = {}
        self.ever: list[int] = []  # every jobID created, deleted ones too

    def teardown(self) -> None:
        for client in self.clients:
            client.close()
        self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # Helpers.

    def ask(self, client: int, method: str, **params: object) -> Reply:
        return self.clients[client].request(method, **params)

    def pick_id(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from([*self.ever, MISSING]), label="jobID")

    def expected_handout(self, pattern: str, priority: int | None, limit: int) -> list[Job]:
        due = [
            job
            for job in self.jobs.values()
            if job.state == "QUEUED"
            and job.due
            and matches(pattern, job.name)
            and (priority is None or job.priority == priority)
        ]
        # protocol.md 4.4: highest priority, oldest nextRun, name, jobID.
        due.sort(key=lambda job: (-job.priority, job.next_run, job.name, job.job_id))
        return due[:limit]

    def check_handed_out(self, objects: list[dict], expected: list[Job]) -> None:
        assert [obj["jobID"] for obj in objects] == [job.job_id for job in expected]
        for obj, job in zip(objects, expected, strict=True):
            expected_fields = (job.name, job.priority, job.repeat)
            assert (obj["name"], obj["priority"], obj["repeat"]) == expected_fields
            assert obj["data"] == {} and obj["retryAfter"] == ""
            assert obj["lastRun"] == "", "a job handed out for the first time has no lastRun yet"
            job.state = "RUNNING"
            job.handed_out = True

    # Rules.

    @rule(
        client=st.integers(0, CLIENTS - 1),
        name=st.sampled_from(NAMES),
        priority=st.sampled_from(PRIORITIES),
        repeats=st.booleans(),
    )
    def create_job(self, client: int, name: str, priority: int | None, repeats: bool) -> None:
        params: dict[str, object] = {"name": name}
        if priority is not None:
            params["priority"] = priority
        if repeats:
            params["repeat"] = REPEAT
        reply = self.ask(client, "CreateJob", **params)
        assert reply.status == "200 OK"
        job_id = reply.json["jobID"]
        assert job_id > max(self.ever, default=0), "jobIDs increase and are never reused"
        stored = self.ask(client, "QueryJob", jobID=job_id).json
        self.jobs[job_id] = Job(
            job_id, name, 500 if priority is None else priority, REPEAT if repeats else "",
            "QUEUED", True, stored["nextRun"],
        )
        self.ever.append(job_id)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        pattern=st.sampled_from(PATTERNS),
        priority=st.sampled_from([None, 500, 1000]),
    )
    def get_job(self, client: int, pattern: str, priority: int | None) -> None:
        params: dict[str, object] = {"name": pattern}
        if priority is not None:
            params["jobPriority"] = priority
        expected = self.expected_handout(pattern, priority, 1)
        reply = self.ask(client, "GetJob", **params)
        if not expected:
            assert (reply.status, reply.body) == ("404 No job found", b"")
            return
        assert reply.status == "200 OK", reply.status
        self.check_handed_out([reply.json], expected)

    @rule(
        client=st.integers(0, CLIENTS - 1),
        pattern=st.sampled_from(PATTERNS),
        count=st.integers(1, 4),
    )
    def get_jobs(self, client: int, pattern: str, count: int) -> None:
        expected = self.expected_handout(pattern, None, count)
        reply = self.ask(client, "GetJobs", name=pattern, numResults=count)
        if not expected:
            assert reply.status == "404 No job found"
            return
        assert reply.status == "200 OK", reply.status
        self.check_handed_out(reply.json["jobs"], expected)

    def finish(self, job_id: int) -> str:
        """FinishJob of `job_id` in the model; the status line it gets."""
        job = self.jobs.get(job_id)
        if job is None:
            return NO_JOB
        if job.state != "RUNNING":
            return NOT_RUNNING
        if job.repeat:
            job.state, job.due = "QUEUED", False
        else:
            del self.jobs[job_id]
        return "200 OK"

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def finish_job(self, client: int, data: st.DataObject) -> None:
        job_id = self.pick_id(data)
        reply = self.ask(client, "FinishJob", jobID=job_id)
        assert reply.status == self.finish(job_id)

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def finish_jobs(self, client: int, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from([*self.ever, MISSING]), min_size=1, max_size=4))
        reply = self.ask(client, "FinishJobs", jobs=[{"jobID": job_id} for job_id in ids])
        assert reply.status == "200 OK", reply.status
        expected = [{"jobID": job_id, "status": self.finish(job_id)} for job_id in ids]
        assert reply.json == {"results": expected}

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def retry_job(self, client: int, data: st.DataObject) -> None:
        job_id = self.pick_id(data)
        job = self.jobs.get(job_id)
        reply = self.ask(client, "RetryJob", jobID=job_id, delay=3600)
        if job is None:
            assert reply.status == NO_JOB
        elif job.state != "RUNNING":
            assert reply.status == NOT_RUNNING
        else:
            assert reply.status == "200 OK"
            job.state, job.due = "QUEUED", False

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def fail_job(self, client: int, data: st.DataObject) -> None:
        job_id = self.pick_id(data)
        job = self.jobs.get(job_id)
        reply = self.ask(client, "FailJob", jobID=job_id)
        if job is None:
            assert reply.status == NO_JOB
        elif job.state != "RUNNING":
            assert reply.status == CANNOT_FAIL
        else:
            assert reply.status == "200 OK"
            job.state = "FAILED"

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def delete_job(self, client: int, data: st.DataObject) -> None:
        job_id = self.pick_id(data)
        job = self.jobs.get(job_id)
        reply = self.ask(client, "DeleteJob", jobID=job_id)
        if job is None:
            assert reply.status == NO_JOB
        elif job.state == "RUNNING":
            assert reply.status == CANNOT_DELETE
        else:
            assert reply.status == "200 OK"
            del self.jobs[job_id]

    @precondition(lambda self: self.ever)
    @rule(client=st.integers(0, CLIENTS - 1), data=st.data())
    def query_job(self, client: int, data: st.DataObject) -> None:
        job_id = self.pick_id(data)
        job = self.jobs.get(job_id)
        reply = self.ask(client, "QueryJob", jobID=job_id)
        if job is None:
            assert reply.status == NO_JOB
            return
        assert reply.status == "200 OK"
        got = reply.json
        assert (got["jobID"], got["name"], got["state"]) == (job_id, job.name, job.state)
        assert (got["priority"], got["repeat"], got["data"]) == (job.priority, job.repeat, {})
        assert (got["lastRun"] != "") == job.handed_out
        if job.due:
            assert got["nextRun"] == job.next_run
        else:
            # Retried with a delay of an hour, or repeating an hour after it finished.
            later = datetime.fromisoformat(got["nextRun"]).replace(tzinfo=UTC)
            assert later > datetime.now(UTC) + timedelta(minutes=59)

    # After every step: the whole table is the model.

    @invariant()
    def table_matches_the_model(self) -> None:
        # Read from the file itself, as a second connection would: Query
        # starts a child process per call, too slow for every step.
        with closing(sqlite3.connect(f"file:{self.dir / 'jobs.db'}?mode=ro", uri=True)) as db:
            rows = db.execute(
                "SELECT jobID, state, name, priority, repeat, nextRun FROM jobs ORDER BY jobID"
            ).fetchall()
        expected = [
            [job.job_id, job.state, job.name, job.priority, job.repeat]
            for job in sorted(self.jobs.values(), key=lambda job: job.job_id)
        ]
        assert [list(row[:5]) for row in rows] == expected
        now = now_text()
        for row in rows:
            job = self.jobs[row[0]]
            # Due jobs are due; the others wait an hour.
            assert (row[5] <= now + ".999") == job.due, (row, job)


JobQueueModel.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestJobQueueModel = JobQueueModel.TestCase
