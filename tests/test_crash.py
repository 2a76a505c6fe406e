"""kill -9 under load: nothing acknowledged is lost, nothing is handed out twice.

Eight client threads create, take and finish jobs against a real server
process while the test kills it with SIGKILL at random moments, twenty
times, restarting it on the same database file each time. The clients keep
a ledger of what the server acknowledged; after every restart (with the
clients paused) and at the end the database must agree with it:

- every acknowledged CreateJob exists (QueryJob 200), unless a FinishJob of
  it was acknowledged or may have been carried out (its connection broke);
- every job whose FinishJob was acknowledged is gone (404: no job repeats);
- a job without retryAfter whose GetJob reply arrived stays RUNNING and is
  never handed out again; a job with retryAfter is handed out again only
  once its lease has ended.

Run with -s to see the figures.
"""

from __future__ import annotations

import itertools
import math
import random
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from helpers import until
from jobserver.client import Client as JobClient
from jobserver.client import ConnectionFailed, JobServerError
from wire import encode

THREADS = 8
RESTARTS = 12
LEASE = "+2 SECONDS"
LEASE_SECONDS = 2
PLAIN, LEASED = "crash/plain", "crash/lease"
# Client-side timeout: far above any reply time, far below the test's budget.
CLIENT_TIMEOUT = 5.0
# Tolerance for comparing times the server wrote with time.time() here.
EPSILON = 0.002


@dataclass
class Handout:
    job_id: int
    leased: bool
    sent: float  # time.time() before the GetJob was sent
    received: float  # time.time() once its reply was read
    next_run: str  # the job's nextRun as the reply shows it (before this hand-out)
    thread: int


@dataclass
class Ledger:
    lock: threading.Lock = field(default_factory=threading.Lock)
    creates_sent: int = 0
    creates_unknown: int = 0  # the connection broke after sending
    created: dict[int, bool] = field(default_factory=dict)  # jobID -> leased
    finished: dict[int, float] = field(default_factory=dict)  # acknowledged FinishJob
    finish_unknown: set[int] = field(default_factory=set)  # may have been carried out
    finish_refused: list[tuple[int, str]] = field(default_factory=list)
    handouts: list[Handout] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Gate:
    """Where the client threads learn the server's port, and park while it
    is down. A thread that lost its connection waits for a generation newer
    than the one it used."""

    def __init__(self, threads: int) -> None:
        self.cond = threading.Condition()
        self.generation = 0
        self.port: int | None = None
        self.parked = 0
        self.threads = threads
        self.stopping = False

    def next_port(self, used: int) -> tuple[int, int] | None:
        with self.cond:
            self.parked += 1
            self.cond.notify_all()
            while not self.stopping and self.generation <= used:
                self.cond.wait()
            self.parked -= 1
            if self.stopping:
                return None
            assert self.port is not None
            return self.generation, self.port

    def open(self, port: int) -> None:
        with self.cond:
            self.port = port
            self.generation += 1
            self.cond.notify_all()

    def all_parked(self) -> bool:
        with self.cond:
            return self.parked == self.threads

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()


def client_thread(index: int, gate: Gate, ledger: Ledger) -> None:
    rng = random.Random(index * 7919 + int(time.time()))
    pending_finish: list[int] = []  # FinishJobs whose outcome is unknown
    generation = 0
    try:
        while (assigned := gate.next_port(generation)) is not None:
            generation, port = assigned
            with JobClient("127.0.0.1", port, timeout=CLIENT_TIMEOUT) as jobs:
                try:
                    while not gate.stopping:
                        one_step(index, rng, jobs, ledger, pending_finish)
                except ConnectionFailed:
                    pass  # the server is gone: park until it is back
    except BaseException as error:  # noqa: BLE001 - reported by the test
        with ledger.lock:
            ledger.errors.append(f"thread {index}: {error!r}")
        with gate.cond:
            gate.threads -= 1
            gate.cond.notify_all()


def one_step(
    index: int, rng: random.Random, jobs: JobClient, ledger: Ledger, pending: list[int]
) -> None:
    if pending:
        finish(jobs, ledger, pending[0], pending, retrying=True)
        return
    if rng.random() < 0.45:
        leased = rng.random() < 0.5
        with ledger.lock:
            ledger.creates_sent += 1
        try:
            job_id = jobs.create_job(
                LEASED if leased else PLAIN, {"by": index}, retry_after=LEASE if leased else None
            )
        except ConnectionFailed as error:
            if "cannot connect" not in str(error):
                with ledger.lock:
                    ledger.creates_unknown += 1
            raise
        with ledger.lock:
            ledger.created[job_id] = leased
        return
    sent = time.time()
    job = jobs.get_job("crash/*", wait=rng.choice([None, 0.2]))
    received = time.time()
    if job is None:
        return
    leased = job["retryAfter"] != ""
    with ledger.lock:
        ledger.handouts.append(Handout(job["jobID"], leased, sent, received, job["nextRun"], index))
    # Most jobs are finished at once; the rest are abandoned: those without
    # a lease must then stay RUNNING for good, the others come back.
    if rng.random() < 0.75:
        finish(jobs, ledger, job["jobID"], pending, retrying=False)


def finish(
    jobs: JobClient, ledger: Ledger, job_id: int, pending: list[int], retrying: bool
) -> None:
    try:
        jobs.finish_job(job_id)
    except ConnectionFailed as error:
        if "cannot connect" not in str(error) and job_id not in pending:
            pending.append(job_id)
            with ledger.lock:
                ledger.finish_unknown.add(job_id)
        raise
    except JobServerError as error:
        if job_id in pending:
            pending.remove(job_id)
        with ledger.lock:
            ledger.finish_refused.append((job_id, error.status))
            leased = ledger.created.get(job_id)
            # A leased job may have been finished by a later holder; a job
            # without a lease has one holder, so only a FinishJob of ours
            # whose reply was lost can explain a 404.
            # A leased job may also have been handed to someone else
            # (405/409 once it was failed or fenced).
            if not (
                (error.code == 404 and (retrying or leased))
                or (error.code in (405, 409) and leased)
            ):
                ledger.anomalies.append(f"FinishJob {job_id} refused: {error.status}")
        return
    if job_id in pending:
        pending.remove(job_id)
    with ledger.lock:
        ledger.finished[job_id] = time.time()


def query_states(port: int, ids: list[int]) -> dict[int, str | None]:
    """QueryJob for each id, pipelined in batches: state, or None for 404."""
    from wire import Client

    states: dict[int, str | None] = {}
    with Client(port, timeout=30) as wire:
        for start in range(0, len(ids), 100):
            batch = ids[start : start + 100]
            wire.send(b"".join(encode("QueryJob", {"jobID": job_id}) for job_id in batch))
            for job_id in batch:
                reply = wire.read_reply()
                if reply.code == 200:
                    states[job_id] = reply.json["state"]
                elif reply.status == "404 No job with this jobID":
                    states[job_id] = None
                else:
                    raise AssertionError(f"QueryJob {job_id}: {reply.status}")
    return states


def check(port: int, ledger: Ledger) -> dict[str, list]:
    """Compare the database with the ledger (clients are paused): the jobs
    lost, the finished jobs that came back, the handed-out jobs in a wrong state."""
    with ledger.lock:
        created = dict(ledger.created)
        finished = set(ledger.finished)
        maybe_finished = set(ledger.finish_unknown)
        received = {h.job_id: h.leased for h in ledger.handouts}
    ids = sorted(set(created) | finished | set(received))
    states = query_states(port, ids)
    found: dict[str, list] = {"lost": [], "resurrected": [], "wrong state": []}
    for job_id in ids:
        state = states[job_id]
        if job_id in finished:
            if state is not None:
                found["resurrected"].append((job_id, state))
            continue
        if job_id in maybe_finished:
            continue
        if job_id in created and state is None:
            found["lost"].append(job_id)
        elif job_id in received and not received[job_id] and state != "RUNNING":
            # Handed out without a lease and never finished: RUNNING for good.
            found["wrong state"].append((job_id, state))
        elif job_id in received and received[job_id] and state not in ("RUNQUEUED", "FAILED"):
            found["wrong state"].append((job_id, state))
    return found


def verify(port: int, ledger: Ledger) -> None:
    found = check(port, ledger)
    assert not any(found.values()), found


def stored_time(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def duplicates(ledger: Ledger) -> tuple[list[str], int]:
    """Hand-outs that break the rules, and the number of legal second
    hand-outs (leases that ended)."""
    by_job: dict[int, list[Handout]] = defaultdict(list)
    for handout in ledger.handouts:
        by_job[handout.job_id].append(handout)
    illegal: list[str] = []
    legal = 0
    for job_id, handouts in by_job.items():
        handouts.sort(key=lambda h: h.received)
        done = ledger.finished.get(job_id)
        # Nothing comes back once its FinishJob was acknowledged.
        illegal.extend(
            f"job {job_id} handed out after its FinishJob was acknowledged"
            for later in handouts
            if done is not None and later.sent > done
        )
        for first, second in itertools.pairwise(handouts):
            if not first.leased:
                illegal.append(f"job {job_id} without a lease handed out twice: {first} / {second}")
                continue
            # The lease runs from the first hand-out (at or after `sent`,
            # in whole seconds) for LEASE_SECONDS; the second hand-out
            # happened at or before `received`.
            earliest = math.floor(first.sent) + LEASE_SECONDS
            if second.received < earliest - EPSILON:
                illegal.append(
                    f"job {job_id} handed out again within its lease: {first} / {second}"
                )
            elif second.received < stored_time(second.next_run) - EPSILON:
                illegal.append(f"job {job_id} handed out before its nextRun: {second}")
            else:
                legal += 1
    return illegal, legal


def test_kill_9_under_load_loses_nothing_and_hands_out_nothing_twice(
    start_server, tmp_path: Path
) -> None:
    db = tmp_path / "crash.db"
    ledger = Ledger()
    gate = Gate(THREADS)
    rng = random.Random()
    threads = [
        threading.Thread(target=client_thread, args=(n, gate, ledger), daemon=True)
        for n in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    restarts = 0
    try:
        server = start_server(db)
        gate.open(server.port)
        for _ in range(RESTARTS):
            # Let the load run for a random moment, then pull the plug.
            time.sleep(rng.uniform(0.05, 0.5))
            server.signal(signal.SIGKILL)
            server.wait()
            assert server.proc.returncode == -signal.SIGKILL
            assert "Traceback" not in server.log and " ERROR " not in server.log, server.log
            until(gate.all_parked, 15, "the client threads to notice the crash")
            assert not ledger.errors, ledger.errors
            server = start_server(db)
            assert server.started, server.log
            restarts += 1
            verify(server.port, ledger)
            gate.open(server.port)
        # The end: stop the load, let every lease run out, and take what is
        # left, so that leased jobs are seen coming back.
        gate.stop()
        for thread in threads:
            thread.join(CLIENT_TIMEOUT * 3)
        assert not any(thread.is_alive() for thread in threads)
        assert not ledger.errors, ledger.errors
        verify(server.port, ledger)
        drain(server.port, ledger)
        found = check(server.port, ledger)
    finally:
        gate.stop()

    illegal, legal = duplicates(ledger)
    acknowledged = len(ledger.created)
    lost = len(found["lost"])
    print(
        f"\ncrash test: {restarts} SIGKILL restarts survived in {time.monotonic() - began:.1f}s; "
        f"CreateJob sent {ledger.creates_sent}, acknowledged {acknowledged} "
        f"({sum(ledger.created.values())} with retryAfter), "
        f"unknown outcome {ledger.creates_unknown}; "
        f"hand-outs {len(ledger.handouts)}, FinishJob acknowledged {len(ledger.finished)}, "
        f"FinishJob unknown outcome {len(ledger.finish_unknown)}, "
        f"refused {len(ledger.finish_refused)}; "
        f"lost {lost}; legal second hand-outs (lease ended) {legal}; "
        f"illegal duplicates {len(illegal)}"
    )
    assert restarts == RESTARTS
    assert acknowledged > 0 and ledger.handouts and ledger.finished
    assert lost == 0, found["lost"]
    assert not found["resurrected"] and not found["wrong state"], found
    assert not ledger.anomalies, ledger.anomalies
    assert illegal == []


def drain(port: int, ledger: Ledger) -> None:
    """Take every job that comes due within a lease and a bit, as one more
    client; leased jobs whose holders walked away come back here."""
    deadline = time.monotonic() + LEASE_SECONDS + 1.5
    with JobClient("127.0.0.1", port, timeout=CLIENT_TIMEOUT) as jobs:
        while (left := deadline - time.monotonic()) > 0:
            sent = time.time()
            job = jobs.get_job("crash/*", wait=left)
            received = time.time()
            if job is None:
                break
            with ledger.lock:
                ledger.handouts.append(
                    Handout(
                        job["jobID"], job["retryAfter"] != "", sent, received, job["nextRun"], -1
                    )
                )
            finish(jobs, ledger, job["jobID"], [], retrying=False)


# The checker itself: it must catch what it is there to catch.


def test_the_checker_flags_a_job_handed_out_twice_or_within_its_lease() -> None:
    ledger = Ledger()
    t = float(math.floor(time.time()))
    ledger.handouts += [
        Handout(1, False, t + 0.1, t + 0.2, "2000-01-01 00:00:00", 0),
        Handout(1, False, t + 5.0, t + 5.1, "2000-01-01 00:00:00", 1),
        Handout(2, True, t + 0.9, t + 0.95, "2000-01-01 00:00:00", 0),
        Handout(2, True, t + 1.5, t + 1.6, "2000-01-01 00:00:00", 1),
        Handout(3, True, t + 0.9, t + 0.95, "2000-01-01 00:00:00", 0),
        Handout(3, True, t + 2.0, t + 2.1, "2000-01-01 00:00:00", 1),
    ]
    illegal, legal = duplicates(ledger)
    assert len(illegal) == 2 and "job 1 " in illegal[0] and "job 2 " in illegal[1]
    assert legal == 1


def test_the_checker_flags_a_lost_job(server) -> None:
    ledger = Ledger()
    with server.client() as client:
        kept = client.request("CreateJob", name=PLAIN).json["jobID"]
        gone = client.request("CreateJob", name=PLAIN).json["jobID"]
        assert client.request("DeleteJob", jobID=gone).status == "200 OK"
    ledger.created = {kept: False, gone: False}
    assert check(server.port, ledger)["lost"] == [gone]
    ledger.finished[gone] = time.time()
    verify(server.port, ledger)
