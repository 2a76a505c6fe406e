"""PostgreSQL drops a node's connections while clients create, take,
finish and fail jobs: every reply is checked against the table at the end
(tests/test_pg_chaos.py runs it briefly, bench/pg_backend_kill.py at length).

What a third party's harness for PostgreSQL job queues does in its
backend-kill scenario (pg_terminate_backend of the queue's active and
idle-in-transaction backends, again and again), against one node: here the
node's own backends only, found by an application_name of the run's own,
so that other tests on the same PostgreSQL are left alone.

The clients are plain sockets that never send anything twice on their own
(tests/wire.py), so that each reply says what the server claims:

- producers: CreateJobs of BATCH jobs (every LARGE_EVERY-th of
  LARGE_BATCH), each with a key of its own in its data;
- workers: a waiting GetJobs, then, of the jobs handed out, a FinishJobs
  for some and a FailJobs for the others (each job may fail once: a retry
  policy of MAX_ATTEMPTS queues it again). A report answered with a 5xx is
  sent again until it is answered otherwise.

The ledger then holds the server to protocol.md section 10:

- created: a job acknowledged (`200`) was handed out or is in the table;
- not created: no job of a CreateJobs answered with a 5xx other than 504
  was ever handed out or is in the table;
- finished: a job whose finish was acknowledged is not in the table and is
  never handed out again;
- failed: a job whose failure was acknowledged, when handed out again,
  counts that attempt;
- not reported: a report answered with a 5xx other than 504 was not
  applied: sent again, it is taken (a `404` or a `409` would say the first
  was applied);
- nothing handed out is left RUNNING once every client has reported.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg

from wire import Client, Reply

BATCH = 5
# Every few requests one of more jobs, whose rows PostgreSQL is sent as
# they are made (postgres_statements.STREAM_AFTER): a kill may land with
# the COPY open.
LARGE_BATCH, LARGE_EVERY = 70, 25
# A job may fail once: its second attempt always finishes.
MAX_ATTEMPTS = 3
NAME = "chaos"
CLIENT_TIMEOUT = 30.0


def with_application(url: str, application: str) -> str:
    """`url` whose connections name themselves `application`."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["application_name"] = application
    return urlunsplit(parts._replace(query=urlencode(query)))


@dataclass
class Ledger:
    """Every reply the clients got, and what it means the table holds."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: dict[str, int] = field(default_factory=dict)  # key -> jobID
    refused: set[str] = field(default_factory=set)  # keys of creates answered 5xx
    unknown: set[str] = field(default_factory=set)  # keys of creates with no answer (or 504)
    handed: Counter[str] = field(default_factory=Counter)  # key -> hand-outs
    handed_after_finish: list[str] = field(default_factory=list)
    finished: set[int] = field(default_factory=set)
    failed_at: dict[int, int] = field(default_factory=dict)  # jobID -> attempt acked failed
    attempts: dict[int, int] = field(default_factory=dict)  # jobID -> last attempt handed out
    violations: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)

    def count(self, command: str, reply: Reply) -> None:
        with self.lock:
            self.statuses[f"{command} {reply.status[:3]}"] += 1

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)


def certain_failure(reply: Reply) -> bool:
    """A 5xx that says nothing was done (protocol.md 10)."""
    return reply.code >= 500 and reply.code != 504


class Chaos:
    """The clients, the killer and the ledger of one run against one node."""

    def __init__(self, port: int, url: str, application: str, kill_every: float) -> None:
        self.port = port
        self.url = url
        self.application = application
        self.kill_every = kill_every
        self.ledger = Ledger()
        self.stop = threading.Event()
        self.draining = threading.Event()
        self.kills = 0

    # The clients.

    def producer(self, number: int) -> None:
        ledger, batch, client = self.ledger, 0, None
        while not self.stop.is_set():
            size = LARGE_BATCH if batch % LARGE_EVERY == LARGE_EVERY - 1 else BATCH
            keys = [f"p{number}-{batch}-{n}" for n in range(size)]
            batch += 1
            jobs = [
                {"name": NAME, "data": {"k": k}, "maxAttempts": MAX_ATTEMPTS, "retryDelay": 0}
                for k in keys
            ]
            try:
                client = client or Client(self.port, CLIENT_TIMEOUT)
                reply = client.request("CreateJobs", jobs=jobs)
            except OSError:
                client = None
                with ledger.lock:
                    ledger.unknown.update(keys)
                continue
            ledger.count("CreateJobs", reply)
            with ledger.lock:
                if reply.code == 200:
                    ledger.acked.update(zip(keys, reply.json["jobIDs"], strict=True))
                elif certain_failure(reply):
                    ledger.refused.update(keys)
                    # As a client would back off: PostgreSQL is out of reach.
                    self.stop.wait(0.01)
                elif reply.code == 504:
                    ledger.unknown.update(keys)
                else:
                    ledger.violations.append(f"CreateJobs answered {reply.status}")

    def worker(self, number: int) -> None:
        client = None
        while not (self.stop.is_set() and self.draining.is_set()):
            try:
                client = client or Client(self.port, CLIENT_TIMEOUT)
                self._work_once(client, number)
            except OSError:
                # The reply to a report may be lost with its connection: the
                # job stays RUNNING, and the end says so.
                client = None
            if self.stop.is_set() and not self.draining.is_set():
                return

    def _work_once(self, client: Client, number: int) -> None:
        ledger = self.ledger
        reply = client.request(
            "GetJobs", name=NAME, numResults=10, Connection="wait", timeout=1000,
            includeLeaseID="true",
        )
        ledger.count("GetJobs", reply)
        if reply.code != 200:
            if self.draining.is_set() and reply.code == 404:
                self.stop.set()
            return
        fail, finish = [], []
        leases = {}
        with ledger.lock:
            for job in reply.json["jobs"]:
                key, job_id, attempt = job["data"]["k"], job["jobID"], job.get("attempt", 1)
                leases[job_id] = job["leaseID"]
                ledger.handed[key] += 1
                if job_id in ledger.finished:
                    ledger.handed_after_finish.append(key)
                failed = ledger.failed_at.get(job_id)
                if failed is not None and attempt <= failed:
                    ledger.violations.append(
                        f"job {job_id} handed out at attempt {attempt} after its attempt "
                        f"{failed} failed"
                    )
                ledger.attempts[job_id] = attempt
                # Every other job fails its first attempt.
                (fail if attempt == 1 and job_id % 2 else finish).append(job_id)
        # Each report names its hand-out's lease: sent again after a 504, it
        # cannot end another worker's attempt of the same job.
        failures = [{"jobID": j, "leaseID": leases[j], "error": "chaos"} for j in fail]
        if failures and not self._report(client, "FailJobs", failures):
            # An older server (bench/pg_backend_kill.py --server-root): one
            # FailJob a job.
            for failure in failures:
                self._report(client, "FailJob", [failure])
        if finish:
            finishes = [{"jobID": j, "leaseID": leases[j]} for j in finish]
            self._report(client, "FinishJobs", finishes)

    def _report(self, client: Client, command: str, elements: list[dict[str, Any]]) -> bool:
        """Send a report until it is answered with something but a 5xx. A
        5xx other than 504 says nothing was done, so every element must
        then be taken when sent again; after a 504 an element may have been
        done (`404 No job with this jobID`, `405` for a job failed and
        queued again, `409` for one handed out again since). False if the
        server does not know the command.
        FailJob (one job) is sent as the element's parameters."""
        ledger, refused, unknown = self.ledger, False, False
        while True:
            if command == "FailJob":
                reply = client.request(command, **elements[0])
            else:
                reply = client.request(command, jobs=elements)
            ledger.count(command, reply)
            if reply.code >= 500:
                unknown = unknown or reply.code == 504
                refused = refused or reply.code != 504
                time.sleep(0.05)
                continue
            if reply.code == 430:
                return False
            if reply.code != 200 and command != "FailJob":
                ledger.violation(f"{command} answered {reply.status}")
                return True
            break
        if command == "FailJob":
            results = [{"jobID": elements[0]["jobID"], "status": reply.status}]
        else:
            results = reply.json["results"]
        with ledger.lock:
            for result in results:
                job_id, status = result["jobID"], result["status"]
                if status != "200 OK":
                    if unknown and status[:3] in ("404", "405", "409"):
                        continue  # the attempt whose outcome was unknown was done
                    ledger.violations.append(
                        f"{command} of job {job_id}: {status}"
                        + (" (sent again after a 5xx: the first was applied)" if refused else "")
                    )
                elif command == "FinishJobs":
                    ledger.finished.add(job_id)
                else:
                    ledger.failed_at[job_id] = ledger.attempts[job_id]
        return True

    # PostgreSQL.

    def killer(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as db:
            while not self.stop.wait(self.kill_every):
                rows = db.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND application_name = %s AND state IN ('active', 'idle in transaction')",
                    (self.application,),
                ).fetchall()
                self.kills += len(rows)

    def table(self) -> dict[str, tuple[int, str]]:
        """Every job left: its key -> (jobID, state)."""
        with psycopg.connect(self.url, autocommit=True) as db:
            rows = db.execute("SELECT jobID, state, data FROM jobs").fetchall()
        return {json.loads(data)["k"]: (int(job_id), str(state)) for job_id, state, data in rows}

    # A run.

    def run(self, seconds: float, producers: int = 2, workers: int = 2) -> list[str]:
        """Load, kills for `seconds`, then the workers drain what is left
        with no kills; the ledger's violations."""
        making = [
            threading.Thread(target=self.producer, args=(n,), daemon=True)
            for n in range(producers)
        ]
        taking = [
            threading.Thread(target=self.worker, args=(n,), daemon=True) for n in range(workers)
        ]
        killing = threading.Thread(target=self.killer, daemon=True)
        for thread in [*making, *taking, killing]:
            thread.start()
        time.sleep(seconds)
        self.stop.set()
        for thread in [*making, killing]:
            thread.join(60)
        for thread in taking:
            thread.join(60)
        # Drained with no kills: every job left is handed out and reported.
        self.stop.clear()
        self.draining.set()
        taking = [
            threading.Thread(target=self.worker, args=(n,), daemon=True) for n in range(workers)
        ]
        for thread in taking:
            thread.start()
        for thread in taking:
            thread.join(120)
        # A drain that never empties the queue (a node stuck) ends here; what
        # it left is counted below.
        self.stop.set()
        return self.check(self.table())

    def check(self, table: dict[str, tuple[int, str]]) -> list[str]:
        ledger = self.ledger
        found = list(ledger.violations)
        lost = [k for k in ledger.acked if k not in table and not ledger.handed[k]]
        behind = [k for k in ledger.refused if k in table or ledger.handed[k]]
        finished_left = [k for k, job_id in ledger.acked.items() if job_id in ledger.finished
                         and k in table]
        stuck = sorted(k for k, (_, state) in table.items() if state in ("RUNNING", "RUNQUEUED"))
        unreported = [k for k, (_, state) in table.items() if state == "QUEUED"]
        for what, keys in (
            ("acknowledged and lost", lost),
            ("created behind a 5xx", behind),
            ("finished (acknowledged) and still in the table", finished_left),
            ("handed out again after an acknowledged finish", ledger.handed_after_finish),
            ("left RUNNING with no one to run them", stuck),
            ("never handed out in the drain", unreported),
        ):
            if keys:
                found.append(f"{len(keys)} jobs {what}: {sorted(keys)[:10]}")
        return found

    def summary(self) -> str:
        ledger = self.ledger
        return (
            f"{self.kills} backends terminated; {len(ledger.acked)} jobs acknowledged, "
            f"{len(ledger.refused)} refused (5xx), {len(ledger.unknown)} unknown; "
            f"{sum(ledger.handed.values())} hand-outs, {len(ledger.finished)} finished, "
            f"{len(ledger.failed_at)} failed once; replies: {dict(sorted(ledger.statuses.items()))}"
        )


def new_application() -> str:
    return f"jobserver-chaos-{secrets.token_hex(4)}"
