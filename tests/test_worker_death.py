"""A worker process dies holding a job.

The worker is a real process using jobserver.client; the test kills it with
SIGKILL. A job with a lease (`retryAfter`) comes back to another worker
when the lease ends, counted in `retryAfterCount`; a worker killed while it
was still waiting takes nothing with it.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

from helpers import until
from jobserver.client import Client as JobClient

WORKER = """
import json, sys, time
from jobserver.client import Client
with Client("127.0.0.1", int(sys.argv[1]), timeout=30) as jobs:
    print("ready", flush=True)
    job = jobs.get_job(sys.argv[2], wait=30)
    print(json.dumps(job), flush=True)
    # The work hangs here until the process is killed.
    time.sleep(3600)
"""


def start_worker(port: int, pattern: str) -> subprocess.Popen[str]:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(port), pattern],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    assert worker.stdout.readline() == "ready\n"
    return worker


def stored_time(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_job_of_a_killed_worker_comes_back_after_its_lease(server) -> None:
    with JobClient("127.0.0.1", server.port, timeout=10) as jobs:
        job_id = jobs.create_job("death/leased", {"payload": 7}, retry_after="+1 SECOND")
        sent = time.time()
        worker = start_worker(server.port, "death/leased")
        try:
            assert worker.stdout is not None
            taken = json.loads(worker.stdout.readline())
            assert taken["jobID"] == job_id
            held = jobs.query_job(job_id)
            assert held["state"] == "RUNQUEUED"
            assert held["data"] == {"payload": 7, "retryAfterCount": 1}
            worker.kill()
            assert worker.wait(10) == -signal.SIGKILL
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()

        # Another worker, waiting: it gets the job once the lease has ended.
        again = jobs.get_job("death/*", wait=10)
        received = time.time()
        assert again is not None, "the job never came back"
        assert again["jobID"] == job_id
        assert again["data"] == {"payload": 7, "retryAfterCount": 1}
        assert again["retryAfter"] == "+1 SECOND"
        # The lease ran from the first hand-out, in whole seconds: not before
        # its end, which the reply shows as the nextRun it had.
        assert received >= math.floor(sent) + 1
        assert received >= stored_time(again["nextRun"]) - 0.002
        assert again["lastRun"] == held["lastRun"]
        assert jobs.query_job(job_id)["data"] == {"payload": 7, "retryAfterCount": 2}
        jobs.finish_job(job_id)
        assert jobs.get_job("death/*") is None


def test_job_of_a_killed_worker_without_a_lease_stays_running(server) -> None:
    with JobClient("127.0.0.1", server.port, timeout=10) as jobs:
        job_id = jobs.create_job("death/plain")
        worker = start_worker(server.port, "death/plain")
        try:
            assert worker.stdout is not None
            assert json.loads(worker.stdout.readline())["jobID"] == job_id
            worker.kill()
            worker.wait(10)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        # Once the server has seen the worker's connection close: the reply
        # was delivered before the worker died, so the job stays its
        # worker's, RUNNING until someone requeues it.
        until(lambda: jobs.status()["connections"] == 1, 10, "the worker's connection to close")
        assert jobs.get_job("death/*") is None
        assert jobs.query_job(job_id)["state"] == "RUNNING"
        jobs.requeue_jobs([job_id])
        assert jobs.get_job("death/*")["jobID"] == job_id


def test_a_worker_killed_while_waiting_takes_nothing(server) -> None:
    with JobClient("127.0.0.1", server.port, timeout=10) as jobs:
        worker = start_worker(server.port, "death/late")
        try:
            until(lambda: jobs.status()["waitingGetJobs"] == 1, 10, "the worker to wait")
            worker.kill()
            worker.wait(10)
            until(lambda: jobs.status()["waitingGetJobs"] == 0, 10, "the wait to end")
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        job_id = jobs.create_job("death/late", retry_after="+1 SECOND")
        # Due at once, not after a lease: nobody took it.
        job = jobs.get_job("death/*")
        assert job is not None and job["jobID"] == job_id
        assert job["data"] == {}
